"""What every stage shares that shapes its data: params, one-line errors and bounded
reading, atomic outputs, the report split into facts and run figures, secret redaction."""
