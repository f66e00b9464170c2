"""What is loaded offline: the bundled tokenizer and its chat templates (templates/), and
the tiny random-weight demo model."""
