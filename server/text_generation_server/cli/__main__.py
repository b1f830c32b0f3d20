"""`python -m text_generation_server.cli`: the same command line as the installed script."""

from text_generation_server.cli.main import app

app()
