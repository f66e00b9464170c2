"""Prompts -> completions -> tokenized training set: one module per DVC stage here (and the
demo and the export), the library they share in subpackages grouped by concern."""
