"""Ed25519 identities: peer ids commit to the key; hivemind's libp2p daemon accepts the file."""

import os
import stat

import pytest

from agora_node.protocol.identity import Identity, IdentityError, public_key_from_peer_id, verify

pytestmark = pytest.mark.timeout(60)


def test_sign_verify_and_forgery():
    a, b = Identity.generate(), Identity.generate()
    sig = a.sign(b"record")
    assert verify(a.peer_id, b"record", sig)
    assert not verify(a.peer_id, b"recorD", sig)
    assert not verify(b.peer_id, b"record", sig)
    assert not verify("QmNotAnEd25519PeerId", b"record", sig)
    assert not verify(a.peer_id, b"record", b"short")
    assert public_key_from_peer_id(a.peer_id) == a.public_raw


def test_load_or_create_is_stable_and_private(tmp_path):
    path = tmp_path / "sub" / "identity.key"
    a = Identity.load_or_create(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Identity.load_or_create(path).peer_id == a.peer_id
    path.write_bytes(b"garbage")
    with pytest.raises(IdentityError):
        Identity.load_or_create(path)


@pytest.mark.integration
def test_libp2p_daemon_uses_our_identity(tmp_path):
    import hivemind

    path = tmp_path / "identity.key"
    ident = Identity.load_or_create(path)
    dht = hivemind.DHT(start=True, identity_path=str(path))
    try:
        assert dht.peer_id.to_base58() == ident.peer_id
    finally:
        dht.shutdown()


def test_a_failed_key_write_leaves_no_copy_of_the_key(tmp_path, monkeypatch):
    """Each failed write (a full disk) left a `.identity.key.*.tmp`, maybe holding the key."""
    import os

    import pytest

    from agora_node.protocol import identity as identity_module

    def full(fd, data):  # noqa: ANN001, ANN202
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(identity_module.os, "write", full)
    with pytest.raises(OSError):
        identity_module.Identity.load_or_create(tmp_path / "identity.key")
    assert os.listdir(tmp_path) == []
