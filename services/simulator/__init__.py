"""`pagedserve simulate`: the real scheduler and KV allocators on a simulated GPU.

Requests drawn from the paper's ShareGPT or Alpaca length distributions arrive as a
Poisson process; a model-free executor produces their tokens and a step-time model
of OPT-13B on an A100 advances the clock. The report gives, per KV policy, where
the pool's memory goes (the paper's Figure 2 categories) and how many requests run
together (its Figure 13).
"""
