"""The tokenized set on disk: its Arrow contract, ids, adopting a foreign base, the lineage
card, charts, the training loader and the training check."""
