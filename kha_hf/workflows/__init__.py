"""`kha demo`: the whole product run end to end on one model (convert, train, evaluate, inspect)."""
