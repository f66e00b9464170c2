"""Looking at rows as the trainer sees them: reading any dataset folder or trainer export,
choosing rows, the text of each token, and the terminal and HTML views (python -m stages.show)."""
