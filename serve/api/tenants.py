"""API keys and the tenants they name.

Each key belongs to one tenant: its own state-cache scope (a prefix cached for one tenant is never restored
for another), its own cache counters on /metrics, and its share of the slots (serve.engine.engine admits the
waiting tenant holding the fewest slots first). Keys come from `--api_key KEY` (repeatable; the tenant is
named `key-` + 12 hex digits of the key's SHA-256, stable across restarts and reorderings) and from
`--api_keys_file FILE`, one `tenant:key` a line (`#` comments and blank lines ignored; several keys may
name one tenant, e.g. while rotating). No keys: one anonymous tenant and no authentication.

Keys are kept only as SHA-256 digests and a presented key is compared with every one of them in constant
time (hmac.compare_digest, no early exit), so neither its content nor which key it is shows in the time taken.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Iterable

TENANT_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


class Tenants:
  """The server's keys: `authenticate(header)` gives the tenant of an Authorization header."""

  def __init__(self, keys: Iterable[tuple[str, str]] = ()):
    """keys: (tenant, key) pairs. ValueError on an empty key, a bad tenant name or a key given twice."""
    self._digests: list[tuple[bytes, str]] = []
    seen: dict[bytes, str] = {}
    for tenant, key in keys:
      if not key:
        raise ValueError(f"tenant {tenant!r} has an empty API key.")
      if not TENANT_NAME.fullmatch(tenant):
        raise ValueError(f"tenant name {tenant[:80]!r}: expected 1 to 64 of A-Z a-z 0-9 _ . -")
      d = _digest(key.encode("utf-8", "surrogateescape"))
      if d in seen and seen[d] != tenant:
        raise ValueError(f"one API key is given to two tenants ({seen[d]!r} and {tenant!r}).")
      seen[d] = tenant
      self._digests.append((d, tenant))
    self.names = sorted(set(seen.values()))

  @property
  def enabled(self) -> bool:
    return bool(self._digests)

  def authenticate(self, header: str | None) -> str | None:
    """The tenant of 'Authorization: Bearer KEY', '' when no keys are set, None for a missing or wrong key."""
    if not self._digests:
      return ""
    scheme, _, token = (header or "").strip().partition(" ")
    got = _digest(token.strip().encode("utf-8", "surrogateescape"))
    found = None
    for d, tenant in self._digests:  # every digest compared: the time does not depend on which key matched
      if hmac.compare_digest(d, got) and scheme.lower() == "bearer":
        found = tenant
    return found


def _digest(key: bytes) -> bytes:
  return hashlib.sha256(b"laplace-api-key\0" + key).digest()


def name_of_key(key: str) -> str:
  """The tenant of a bare `--api_key KEY`."""
  return "key-" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:12]


def read_keys_file(path: str) -> list[tuple[str, str]]:
  """(tenant, key) pairs of a keys file: `tenant:key` a line. Errors name the line, never the key."""
  try:
    with open(path, encoding="utf-8") as f:
      lines = f.read().splitlines()
  except (OSError, UnicodeDecodeError) as e:
    raise ValueError(
      f"--api_keys_file={path} cannot be read ({type(e).__name__}: {getattr(e, 'strerror', '')})."
      " Pass a UTF-8 text file of 'tenant:key' lines."
    ) from None
  out = []
  for n, line in enumerate(lines, 1):
    line = line.strip()
    if not line or line.startswith("#"):
      continue
    tenant, sep, key = line.partition(":")
    if not sep or not TENANT_NAME.fullmatch(tenant.strip()) or not key.strip():
      raise ValueError(
        f"--api_keys_file={path}, line {n}: expected 'tenant:key' with a tenant name of 1 to 64 "
        "of A-Z a-z 0-9 _ . - and a non-empty key."
      )
    out.append((tenant.strip(), key.strip()))
  if not out:
    raise ValueError(
      f"--api_keys_file={path} holds no 'tenant:key' line: with no keys the server would be "
      "open to anyone. Add keys, or leave the flag out to serve without keys."
    )
  return out
