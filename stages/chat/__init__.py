"""The chat format: the conversation contract, rendering and loss masks, thinking text,
what a completion keeps of the engine's token ids, and the check of renders against them."""
