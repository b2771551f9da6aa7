"""API keys and what they decide: who may call, whose prefix-cache blocks are whose, and who sees the
prefix-cache figures on /metrics.

- Any of the configured keys (`--api-key`, repeatable, or `--api-key-file` with one per line) opens
  every route but /health, which stays open.
- With `cache_salt_by_api_key`, each request's cache salt starts with a digest of its key, so
  requests of different keys never share prefix-cache blocks, and a tenant learns nothing of the
  others' prompts from cache hits or their timing. A client's own `cache_salt` is added to its key's,
  never in its place.
- A prefix-cache hit rate moves with each request, so it tells whoever reads /metrics whether a
  guessed prompt prefix was sent before. It is shown only where no other tenant can be probed: to
  the holder of `metrics_api_key` when one is set (which opens /metrics only), else only while fewer
  than two API keys are configured (one tenant).
"""

import hashlib
import hmac
from typing import Optional, Sequence

_TENANT_SALT_PREFIX = b"tokenmill-tenant\0"


def bearer_token(headers: dict) -> Optional[bytes]:
    """The token of an `Authorization: Bearer TOKEN` header (ASGI headers: bytes -> bytes), or None."""
    value = headers.get(b"authorization", b"")
    scheme, _, token = value.partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


class Tenants:
    def __init__(self, api_keys: Sequence[str] = (), metrics_api_key: Optional[str] = None,
                 cache_salt_by_api_key: bool = False):
        self.api_keys = [k.encode() for k in dict.fromkeys(api_keys)]
        self.metrics_api_key = metrics_api_key.encode() if metrics_api_key else None
        self.cache_salt_by_api_key = cache_salt_by_api_key
        # Salts are digests, so neither logs nor hashes hold a key itself.
        self._salts = {k: hashlib.sha256(_TENANT_SALT_PREFIX + k).hexdigest() for k in self.api_keys}

    @property
    def required(self) -> bool:
        """Whether a key is needed at all (on some route)."""
        return bool(self.api_keys) or self.metrics_api_key is not None

    @staticmethod
    def _matches(token: Optional[bytes], keys: Sequence[bytes]) -> bool:
        # Every key is compared (no early exit), each in constant time.
        found = False
        for key in keys:
            found |= token is not None and hmac.compare_digest(token, key)
        return found

    def authorized(self, path: str, headers: dict) -> bool:
        token = bearer_token(headers)
        if path == "/metrics" and self.metrics_api_key is not None:
            return self._matches(token, [self.metrics_api_key] + self.api_keys)
        return not self.api_keys or self._matches(token, self.api_keys)

    def shows_prefix_cache(self, headers: dict) -> bool:
        """Whether a /metrics caller (already authorized) sees the prefix-cache figures."""
        if self.metrics_api_key is not None:
            return self._matches(bearer_token(headers), [self.metrics_api_key])
        return len(self.api_keys) < 2

    def cache_salt(self, headers: dict, client_salt: Optional[str]) -> Optional[str]:
        """A request's cache salt: the client's, behind its key's digest when salting by key."""
        if not self.cache_salt_by_api_key:
            return client_salt
        key_salt = self._salts.get(bearer_token(headers) or b"")
        if key_salt is None:  # no keys configured (refused at start-up) or no key: the client's alone
            return client_salt
        if client_salt is None:
            return f"key:{key_salt}"
        return f"key:{key_salt}\0client:{hashlib.sha256(client_salt.encode('utf-8')).hexdigest()}"
