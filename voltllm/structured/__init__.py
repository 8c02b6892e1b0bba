"""Structured outputs (guided decoding) through xgrammar: grammars from constraints, per-request matchers."""
