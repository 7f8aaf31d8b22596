"""Injectable signing for membership messages.

Real members sign with the Ed25519 key their libp2p peer id commits to and check
signatures against the key recovered from the sender's peer id (no key directory
needed). The simulator injects `NullSigner`/`null_verify`: Ed25519 costs ~100 us
per operation, which would dominate a thousand-node run, yet the null signature
keeps the real 64 bytes so message sizes stay honest.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from agora_node.comms.membership.messages import NO_SIGNATURE
from agora_node.protocol.identity import Identity, IdentityError, public_key_from_peer_id

Verifier = Callable[[str, bytes, bytes], bool]
"""verify(signer_peer_id, message, signature) -> bool"""


class Signer(Protocol):
    """Anything with a peer id that can sign bytes (an `Identity` is one)."""

    @property
    def peer_id(self) -> str: ...

    def sign(self, message: bytes) -> bytes: ...


class NullSigner:
    """Signs nothing but keeps the 64-byte signature slot (for simulations)."""

    def __init__(self, peer_id: str) -> None:
        self._peer_id = peer_id

    @property
    def peer_id(self) -> str:
        return self._peer_id

    def sign(self, message: bytes) -> bytes:
        return NO_SIGNATURE


def null_verify(peer_id: str, message: bytes, signature: bytes) -> bool:
    return True


class Ed25519Verifier:
    """Verifies against the key a peer id commits to; caches parsed keys because
    decoding a base58 peer id and loading the key costs more than it should per message."""

    def __init__(self, max_cached: int = 10_000) -> None:
        self._keys: dict[str, Ed25519PublicKey | None] = {}
        self._max_cached = max_cached

    def _key(self, peer_id: str) -> Ed25519PublicKey | None:
        if peer_id in self._keys:
            return self._keys[peer_id]
        try:
            key = Ed25519PublicKey.from_public_bytes(public_key_from_peer_id(peer_id))
        except (IdentityError, ValueError):
            key = None
        if len(self._keys) >= self._max_cached:
            self._keys.clear()
        self._keys[peer_id] = key
        return key

    def __call__(self, peer_id: str, message: bytes, signature: bytes) -> bool:
        key = self._key(peer_id)
        if key is None:
            return False
        try:
            key.verify(signature, message)
        except InvalidSignature:
            return False
        return True


def ed25519(identity: Identity) -> tuple[Signer, Verifier]:
    """The (signer, verifier) pair real members use."""
    return identity, Ed25519Verifier()
