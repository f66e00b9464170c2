"""Talking to inference engines: the client, what a reply must be, the request cache,
fitting max_tokens into the context, engine processes and their logs."""
