#!/usr/bin/env bash
# TEST-ONLY certificates for tests/https_upstream.rs: a throwaway CA and a server certificate it
# signed for `localhost` and 127.0.0.1 (ECDSA P-256, valid for 100 years so the tests never
# expire). The CA's key is deleted once it has signed, and the server's key is public in this
# repository: never trust ca.pem anywhere but in these tests.
#
# Run from anywhere to regenerate all three files (ca.pem, server.pem, server.key).
set -euo pipefail
cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$tmp/ca.key"
openssl req -x509 -new -key "$tmp/ca.key" -sha256 -days 36500 \
    -subj "/CN=floodgate test CA (test only)" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out ca.pem

openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out server.key
openssl req -new -key server.key -subj "/CN=localhost" -out "$tmp/server.csr"
cat > "$tmp/server.ext" <<'EXT'
basicConstraints=critical,CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth
subjectAltName=DNS:localhost,IP:127.0.0.1
EXT
openssl x509 -req -in "$tmp/server.csr" -CA ca.pem -CAkey "$tmp/ca.key" -set_serial "0x$(openssl rand -hex 16)" \
    -sha256 -days 36500 -extfile "$tmp/server.ext" -out server.pem
