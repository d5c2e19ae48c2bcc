"""Tokenizer/detokenizer stage."""
