"""`specdecode advise`: measure which drafter pays on the user's prompts and machine (cli.py)."""
