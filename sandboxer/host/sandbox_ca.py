"""A sandbox's own certificate authority, for the credential routes' TLS termination.

Made at create (or warm start) with `cryptography`: an EC P-256 key, CA:true with path length 0
(it signs leaves, never another CA), valid for `days`. Its certificate goes into the sandbox's
trust bundle; its key never enters the sandbox: it lives in the service's memory and, so a
restarted service can reload it, in an owner-only file outside every mount (`write_key`).
Leaf certificates are made per routed host on first use, valid for at most a day past the CA's
own end, and cached in this object with their `ssl.SSLContext`. The standard `ssl` module loads a
certificate only from a path, so a leaf's PEM goes through a memfd, never a file on disk.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import ssl
import threading

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_DAYS = 400  # longer than any sandbox lives (its lifetime is the owner's, bounded)
LEAF_DAYS = 7
RENEW_BEFORE = datetime.timedelta(days=1)  # a leaf is made again this long before it ends
BACKDATE = datetime.timedelta(minutes=5)  # the sandbox's clock is the host's, but be forgiving


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


class SandboxCA:
    """One sandbox's CA: its certificate (for the trust bundle) and key (for signing leaves)."""

    def __init__(self, certificate: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.certificate = certificate
        self._key = key
        self._leaves: dict[str, tuple[ssl.SSLContext, datetime.datetime]] = {}  # host: (context, its end)
        self._lock = threading.Lock()  # the service may ask from its loop and its threads

    @classmethod
    def create(cls, name: str, *, days: int = CA_DAYS) -> SandboxCA:
        """A new CA named `sandboxer <name>` (the sandbox id), valid from now for `days`."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        subject = _name(f"sandboxer {name}")
        public = key.public_key()
        certificate = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(public)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=False,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(certificate, key)

    @classmethod
    def load(cls, certificate_pem: bytes, key_pem: bytes) -> SandboxCA:
        """The CA a previous service made (its record's certificate, its key file)."""
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("a sandbox CA's key is an EC key")
        return cls(x509.load_pem_x509_certificate(certificate_pem), key)

    @property
    def certificate_pem(self) -> bytes:
        """The certificate, for the sandbox's trust bundle."""
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def key_pem(self) -> bytes:
        """The key in PKCS#8 PEM (for `write_key` only: it never goes near the sandbox)."""
        return self._key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def write_key(self, path: str) -> None:
        """Write the key to a new owner-only file at `path` (never over an existing one or a link)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(path, flags, 0o600)
        try:
            os.write(fd, self.key_pem())
        finally:
            os.close(fd)

    def server_context(self, host: str) -> ssl.SSLContext:
        """A TLS server context presenting a leaf for `host` signed by this CA, made again a day
        before the last one ends (a service runs for weeks). ValueError once the CA itself has
        ended: no leaf can be made then (the proxy refuses the request, 502)."""
        now = datetime.datetime.now(datetime.UTC)
        with self._lock:
            made = self._leaves.get(host)
            if made is None or made[1] - now < RENEW_BEFORE:
                made = self._leaves[host] = self._leaf_context(host, now)
            return made[0]

    def _leaf_context(self, host: str, now: datetime.datetime) -> tuple[ssl.SSLContext, datetime.datetime]:
        if self.certificate.not_valid_after_utc <= now + RENEW_BEFORE:
            raise ValueError("the sandbox's CA has ended")
        key = ec.generate_private_key(ec.SECP256R1())
        end = min(now + datetime.timedelta(days=LEAF_DAYS), self.certificate.not_valid_after_utc)
        try:
            alternative: x509.GeneralName = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            alternative = x509.DNSName(host)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(_name(host))
            .issuer_name(self.certificate.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([alternative]), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False)
            .sign(self._key, hashes.SHA256())
        )
        chain = certificate.public_bytes(serialization.Encoding.PEM) + self.certificate_pem
        secret = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        fd = os.memfd_create("sandboxer-leaf", os.MFD_CLOEXEC)
        try:
            os.write(fd, secret + chain)
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return context, end


CA_DIR = "egress"  # in the sandbox's directory on the host: outside every mount of the sandbox
CA_CERT, CA_KEY = "ca.pem", "ca.key"
SYSTEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt")


def make_ca(sandbox_dir: str, sandbox_id: str) -> SandboxCA:
    """A new CA for the sandbox, its certificate and key kept in `<sandbox_dir>/egress/` (0700,
    the key 0600), where the next service reloads them (`load_ca`)."""
    ca = SandboxCA.create(sandbox_id)
    directory = os.path.join(sandbox_dir, CA_DIR)
    os.mkdir(directory, 0o700)
    ca.write_key(os.path.join(directory, CA_KEY))
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(os.path.join(directory, CA_CERT), flags, 0o600)
    try:
        os.write(fd, ca.certificate_pem)
    finally:
        os.close(fd)
    return ca


def load_ca(sandbox_dir: str) -> SandboxCA | None:
    """The sandbox's CA as `make_ca` kept it; None when it has none (no credential route)."""
    directory = os.path.join(sandbox_dir, CA_DIR)
    try:
        with open(os.path.join(directory, CA_CERT), "rb", opener=_no_follow) as cert:
            certificate = cert.read()
        with open(os.path.join(directory, CA_KEY), "rb", opener=_no_follow) as key:
            key_pem = key.read()
    except FileNotFoundError:
        return None
    return SandboxCA.load(certificate, key_pem)


def trust_bundle(ca: SandboxCA) -> bytes:
    """What the sandbox trusts: the host's CA bundle (so hosts without a route verify as usual)
    and the sandbox's own CA (so a routed host's leaf does)."""
    system = ssl.get_default_verify_paths().cafile
    for path in (system, *SYSTEM_BUNDLES):
        if path and os.path.isfile(path):
            with open(path, "rb") as bundle:
                return bundle.read().rstrip(b"\n") + b"\n" + ca.certificate_pem
    return ca.certificate_pem


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)
