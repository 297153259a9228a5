"""Developer tools that read the code: `cli_docs` (docs/cli.md)."""
