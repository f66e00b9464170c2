"""The files that carry rows from one stage to the next, inside the folders dvc.yaml names
(each stage's folder option: `--prompts`, `--completions`, ...)."""

PROMPTS_FILE = "prompts.jsonl"  # prepare writes it, generate reads it
COMPLETIONS_FILE = "completions.jsonl"  # generate writes it, tokenize reads it
# beside it: the prompts that failed, with why (generate writes it; a user reads it)
FAILURES_FILE = "failures.jsonl"
# beside it: the model and sampling params the rows were generated with (tokenize follows
# their enable_thinking) and why rows may lack the engine's token ids
GENERATION_FILE = "generation.json"
