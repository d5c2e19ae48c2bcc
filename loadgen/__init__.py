"""loadgen: load and capacity testing of any OpenAI-compatible completion server.

It talks HTTP and server-sent events only, so it measures pagedserve and its peers alike:
`python -m loadgen run|capacity|sweep|compare` (or `pagedserve-loadgen`). See README.md,
section "Load generator".
"""
