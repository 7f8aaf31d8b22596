"""Node identity: an Ed25519 key whose libp2p peer id commits to the public key.

A libp2p peer id for an Ed25519 key is an *identity* multihash of the protobuf
encoded public key, so anyone can recover the public key from the peer id alone
and check a signature without a directory of keys. That is what lets every
record and membership message be verified without a coordinator.

The key file uses libp2p's protobuf `PrivateKey` format (key type Ed25519, data =
private 32 bytes + public 32 bytes), which the libp2p daemon bundled with
hivemind loads as its host identity. The protobuf is tiny and fixed, so it is
encoded by hand here instead of importing libp2p's generated classes.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

_B58_ALPHABET = "123456789ABCDEFGHJKLMNPQRSTUVWXYZabcdefghijkmnopqrstuvwxyz"
_ED25519 = 1  # libp2p crypto.pb KeyType.Ed25519
# protobuf headers: field 1 (varint) = key type, field 2 (bytes) = key data
_PUBKEY_PB_PREFIX = bytes([0x08, _ED25519, 0x12, 32])
_PRIVKEY_PB_PREFIX = bytes([0x08, _ED25519, 0x12, 64])
_IDENTITY_MULTIHASH = bytes([0x00, len(_PUBKEY_PB_PREFIX) + 32])


class IdentityError(ValueError):
    """An identity file or peer id that cannot be used."""


def b58encode(data: bytes) -> str:
    n = int.from_bytes(data, "big")
    out = []
    while n:
        n, r = divmod(n, 58)
        out.append(_B58_ALPHABET[r])
    pad = len(data) - len(data.lstrip(b"\0"))
    return "1" * pad + "".join(reversed(out))


def b58decode(text: str) -> bytes:
    n = 0
    for ch in text:
        idx = _B58_ALPHABET.find(ch)
        if idx < 0:
            raise IdentityError(f"invalid base58 character {ch!r} in peer id")
        n = n * 58 + idx
    body = n.to_bytes((n.bit_length() + 7) // 8, "big") if n else b""
    pad = len(text) - len(text.lstrip("1"))
    return b"\0" * pad + body


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def peer_id_from_public_key(public_raw: bytes) -> str:
    """The libp2p peer id (base58, `12D3KooW...`) of a raw 32-byte Ed25519 public key."""
    if len(public_raw) != 32:
        raise IdentityError("an Ed25519 public key has 32 bytes")
    return b58encode(_IDENTITY_MULTIHASH + _PUBKEY_PB_PREFIX + public_raw)


def public_key_from_peer_id(peer_id: str) -> bytes:
    """Recover the raw Ed25519 public key a peer id commits to (raises IdentityError)."""
    raw = b58decode(peer_id)
    head = _IDENTITY_MULTIHASH + _PUBKEY_PB_PREFIX
    if len(raw) != len(head) + 32 or not raw.startswith(head):
        raise IdentityError(f"peer id {peer_id[:16]}... is not an Ed25519 identity peer id")
    return raw[len(head) :]


def verify(peer_id: str, message: bytes, signature: bytes) -> bool:
    """True iff `signature` over `message` was made by the key `peer_id` commits to."""
    try:
        public = Ed25519PublicKey.from_public_bytes(public_key_from_peer_id(peer_id))
        public.verify(signature, message)
    except (IdentityError, InvalidSignature, ValueError, TypeError):
        return False
    return True


@dataclass(frozen=True)
class Identity:
    """A node's signing key and the peer id derived from it."""

    private_key: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_raw(self) -> bytes:
        return _raw_public(self.private_key.public_key())

    @property
    def peer_id(self) -> str:
        return peer_id_from_public_key(self.public_raw)

    def sign(self, message: bytes) -> bytes:
        return self.private_key.sign(message)

    def to_libp2p_bytes(self) -> bytes:
        private_raw = self.private_key.private_bytes(
            serialization.Encoding.Raw,
            serialization.PrivateFormat.Raw,
            serialization.NoEncryption(),
        )
        return _PRIVKEY_PB_PREFIX + private_raw + self.public_raw

    @classmethod
    def from_libp2p_bytes(cls, data: bytes) -> Identity:
        if len(data) != len(_PRIVKEY_PB_PREFIX) + 64 or not data.startswith(_PRIVKEY_PB_PREFIX):
            raise IdentityError(
                "identity file is not an Ed25519 libp2p private key "
                "(agora-node creates one if the path does not exist)"
            )
        body = data[len(_PRIVKEY_PB_PREFIX) :]
        identity = cls(Ed25519PrivateKey.from_private_bytes(body[:32]))
        if identity.public_raw != body[32:]:
            raise IdentityError("identity file is corrupt: public key does not match private key")
        return identity

    @classmethod
    def load_or_create(cls, path: str | os.PathLike) -> Identity:
        """Load the identity at `path`, or create it there with 0600 permissions."""
        path = Path(path)
        if path.exists():
            return cls.from_libp2p_bytes(path.read_bytes())
        identity = cls.generate()
        path.parent.mkdir(parents=True, exist_ok=True)
        # a fresh random name (O_EXCL, mode 0600): a file or symlink planted at a fixed
        # temporary name would have received the private key
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            try:
                os.write(fd, identity.to_libp2p_bytes())
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:  # a full disk: no stray copy of a private key left behind
            Path(tmp).unlink(missing_ok=True)
            raise
        return identity
