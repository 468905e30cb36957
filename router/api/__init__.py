"""The HTTP surfaces: TGI's routes, OpenAI's, their validation, guards, errors and /info, over one Service."""
