"""`python -m launcher` runs cb-launcher."""
from launcher.main import app

app()
