"""Who made a bundle: ed25519 signatures over a bundle's manifest, and the keys this machine trusts.

A key pair is two files: the private key (PEM, PKCS#8, written 0600) and its public key, 64 hex digits (the raw
32-byte ed25519 key). `ft trust keygen` makes them, `ft bundle pack --sign KEY` signs, `ft trust add HEX` adds a public
key to the trust store (one key per line, `# comment` allowed; `$FT_HOME/trusted_keys`, default `~/.config/ft`).
A signature is JSON {"scheme": "ed25519", "key": HEX, "signature": HEX} over the manifest's exact bytes; since the
manifest holds every file's sha256, it vouches for every byte. Trust gates what executes (prebuilt kernels); weights,
plans and configs are data and never execute.
"""

from __future__ import annotations

import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from .home import ft_home


class TrustError(ValueError):
    """A signature that does not verify, or a key file that is not what it should be."""


def store_path() -> Path:
    return ft_home() / "trusted_keys"


def keygen(private: Path) -> str:
    """Write a new private key to `private` (0600, refusing to overwrite) and its public key to `private`.pub;
    returns the public key's hex."""
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(private, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub = _hex(key.public_key())
    Path(str(private) + ".pub").write_text(pub + "\n")
    return pub


class Signer:
    def __init__(self, private: Path):
        try:
            key = serialization.load_pem_private_key(Path(private).read_bytes(), password=None)
        except (ValueError, TypeError) as e:
            raise TrustError(f"{private}: not an unencrypted PEM private key ({e})") from None
        if not isinstance(key, Ed25519PrivateKey):
            raise TrustError(f"{private}: not an ed25519 key")
        self._key = key
        self.public = _hex(key.public_key())

    def sign(self, data: bytes) -> dict:
        return {"scheme": "ed25519", "key": self.public, "signature": self._key.sign(data).hex()}


def check(data: bytes, signature: dict | None, trusted: set[str]) -> str | None:
    """The signer's public key hex if `signature` verifies over `data` and the key is trusted; None when unsigned
    or signed by a key not trusted here. Raises TrustError for a signature that does not verify (tampering)."""
    if signature is None:
        return None
    if not isinstance(signature, dict) or signature.get("scheme") != "ed25519":
        raise TrustError("the bundle's signature is malformed or not ed25519")
    try:
        key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(signature["key"]))
        key.verify(bytes.fromhex(signature["signature"]), data)
    except (KeyError, TypeError, ValueError, InvalidSignature):
        raise TrustError("the bundle's signature does not verify: its manifest was changed after signing") from None
    return signature["key"] if signature["key"] in trusted else None


def trusted_keys(path: Path | None = None) -> set[str]:
    p = path or store_path()
    if not p.exists():
        return set()
    return {line.split("#", 1)[0].strip() for line in p.read_text().splitlines()} - {""}


def add(key_hex: str, path: Path | None = None) -> Path:
    """Add a public key (64 hex digits) to the trust store; returns the store's path."""
    key_hex = key_hex.strip().lower()
    try:
        Ed25519PublicKey.from_public_bytes(bytes.fromhex(key_hex))
    except ValueError:
        raise TrustError(f"{key_hex!r} is not an ed25519 public key (64 hex digits)") from None
    p = path or store_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    if key_hex not in trusted_keys(p):
        with open(p, "a") as f:
            f.write(key_hex + "\n")
    return p


def _hex(pub: Ed25519PublicKey) -> str:
    return pub.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
