"""Prompts -> completions -> tokenized training set, one DVC stage per module."""
