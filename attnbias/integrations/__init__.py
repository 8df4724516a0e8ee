"""Integrations with other libraries, each in its own module and imported only when used.

- :mod:`attnbias.integrations.transformers`: Hugging Face transformers models on attnbias
  (``register()``, then ``attn_implementation="attnbias"``).
"""
