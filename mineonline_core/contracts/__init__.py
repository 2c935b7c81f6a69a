"""What a plugin author reads: the hook specifications and the interfaces a component implements
(policy, fragment store, logger, environment factory) with the fragment layout they exchange.
Nothing here starts Ray or imports torch at import time, except ``policy`` (a torch module base)."""
