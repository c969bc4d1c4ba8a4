"""Integrations of kvoffload with serving stacks. Each is a submodule that
imports its stack only when used (importing this package imports nothing):

- kvoffload.integrations.transformers: the prefix and swap tier of
  transformers' continuous batching (generate_batch,
  ContinuousBatchingManager), transformers 5.17.
"""
