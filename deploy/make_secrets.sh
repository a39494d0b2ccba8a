#!/bin/sh
# Development secrets for deploy/compose.yaml and deploy/k8s: a CA, TLS certificates for the
# scheduler and the gateway, the gateway's client certificate (mutual TLS to the scheduler), and
# an API keys file with one random key. Production: use your own CA (cert-manager ...) and keys.
#
#   sh deploy/make_secrets.sh [DIR]          # default deploy/secrets (git-ignored)
#
# Writes DIR/ca.crt, scheduler.{crt,key}, gateway.{crt,key}, gateway-client.{crt,key}, api-keys.
# Certificates name the compose services and the Kubernetes Services (scheduler,
# kvmesh-scheduler, gateway, kvmesh-gateway) and localhost / 127.0.0.1. Needs openssl.
set -eu
DIR=${1:-$(dirname "$0")/secrets}
DAYS=${KVMESH_CERT_DAYS:-365}
mkdir -p "$DIR"
cd "$DIR"
umask 077

key() { openssl ecparam -name prime256v1 -genkey -noout | openssl pkcs8 -topk8 -nocrypt -out "$1"; }

key ca.key
openssl req -x509 -new -key ca.key -sha256 -days "$DAYS" -subj "/CN=kvmesh dev CA" -out ca.crt \
  -addext "basicConstraints=critical,CA:true" -addext "keyUsage=critical,keyCertSign,cRLSign"

# cert NAME CN EXTENSIONS: NAME.key, NAME.crt signed by the CA
cert() {
  key "$1.key"
  openssl req -new -key "$1.key" -subj "/CN=$2" -out "$1.csr"
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 -days "$DAYS" \
    -extfile "$1.ext" -out "$1.crt"
  rm -f "$1.csr" "$1.ext"
}

cert scheduler kvmesh-scheduler "subjectAltName=DNS:scheduler,DNS:kvmesh-scheduler,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
cert gateway kvmesh-gateway "subjectAltName=DNS:gateway,DNS:kvmesh-gateway,DNS:localhost,IP:127.0.0.1
extendedKeyUsage=serverAuth"
cert gateway-client kvmesh-gateway "extendedKeyUsage=clientAuth"
rm -f ca.srl

if [ ! -f api-keys ]; then       # keep existing keys: rerunning must not lock clients out
  printf '# TENANT:KEY per line (gateway/auth.py); delete a line to revoke its key\ndefault:sk-%s\n' \
    "$(openssl rand -hex 24)" > api-keys
fi
# the containers run as uid 1000, not as the files' owner (compose bind-mounts them); the CA key stays 600
chmod 644 ./*.crt api-keys scheduler.key gateway.key gateway-client.key
echo "kvmesh: secrets in $DIR (CA ca.crt; API keys in api-keys)"
