"""Prompt sources: streamed row readers, the chat layouts rows come in, tool turns settled
for engines, and decontamination against evaluation sets."""
