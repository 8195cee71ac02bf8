"""Structured outputs: output constrained to a JSON schema, a regex, a choice or an EBNF grammar, through
xgrammar (github.com/mlc-ai/xgrammar; the grammar engine vLLM and SGLang use).

The pieces, each with one job:
  grammar.py   a request's constraint -> xgrammar Grammar (frontend check: a bad one is a 400)
  manager.py   in the engine core: compiles grammars on worker threads (cache keyed by the constraint), one
               matcher per request, fills the step's token bitmask on the CPU
  bitmask.py   applies the bitmask to the logits on the device, right before sampling (the runner's one call)
"""
