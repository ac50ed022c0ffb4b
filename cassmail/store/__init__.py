"""Mail stores: the contract in `base`, one module per backend.

Protocols import `cassmail.store.base` only; which backend runs is decided by
`cassmail.server.make_store` from settings.
"""
