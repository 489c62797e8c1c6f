"""L3 stores (docs/design.md §8): one rank's CPU blocks as objects outside the deployment, in Mooncake Store
(`mooncake://HOST:PORT`) or a local directory (`file:///DIR`). The transfer managers use them; the engine
only asks what exists."""
from .base import BlockStore, StoreError
from .keys import ObjectKeys, as_hashes, check_namespace, fingerprint
from .url import StoreURL, open_store, parse_store_url

__all__ = ["BlockStore", "StoreError", "ObjectKeys", "as_hashes", "check_namespace", "fingerprint", "StoreURL",
           "open_store", "parse_store_url"]
