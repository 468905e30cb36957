"""`python -m router`: the router process. Its settings come from the launcher (CB_SETTINGS, see settings.py);
only where the model and the shards are is given here."""
import gc

import typer

app = typer.Typer(add_completion=False, rich_markup_mode=None)


@app.command()
def main(model_dir: str = typer.Option(..., help="the converted model (tokenizer, generation config)"),
         uds: str = typer.Option(..., help="comma-separated shard sockets, rank 0 first")):
    from router.server import serve
    from router.settings import Settings

    serve(Settings.from_env(), model_dir, uds.split(","))
    gc.freeze()  # the interpreter's last collection walks every object torch and transformers made: ~1 s to exit


if __name__ == "__main__":
    app()
