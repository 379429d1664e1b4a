#!/usr/bin/env bash
# The certificates of ha/'s etcd, made with openssl, and the two Secrets that carry them:
#
#   sarcomm-etcd-peer    ca.crt, tls.crt, tls.key: the etcd members' server and peer certificate
#                        (names sarcomm-etcd-N.sarcomm-etcd[.NAMESPACE.svc[.cluster.local]])
#   sarcomm-etcd-client  ca.crt, tls.crt, tls.key: the coordinators' client certificate
#                        (CN sarcomm-coordinator)
#
# signed by a CA made for this etcd alone: etcd's --client-cert-auth admits any certificate that
# CA signed, so it must sign nothing else. The CA's key is left in DIR (keep it offline, or delete
# it and make new certificates when they expire); no key is ever written into the repository.
#
#   bash deploy/kubernetes/ha/etcd-certs.sh [--apply] NAMESPACE DIR
#
# writes the files to DIR (created, mode 0700); with --apply also creates the Secrets in
# NAMESPACE with kubectl. Certificates last SARCOMM_CERT_DAYS days (365); the peer certificate
# names SARCOMM_ETCD_MEMBERS members (3, etcd.yaml's replicas).
# cert-manager instead: one Issuer of kind CA, and two Certificates with secretName
# sarcomm-etcd-peer (usages server auth and client auth, dnsNames as above) and
# sarcomm-etcd-client (usage client auth, commonName sarcomm-coordinator); its Secrets carry
# the same three keys.
set -euo pipefail
apply=0
if [ "${1:-}" = "--apply" ]; then apply=1; shift; fi
if [ $# -ne 2 ]; then sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2; exit 2; fi
namespace="$1"
dir="$2"
days="${SARCOMM_CERT_DAYS:-365}"
members="${SARCOMM_ETCD_MEMBERS:-3}"
mkdir -p "$dir"
chmod 0700 "$dir"
cd "$dir"
umask 077

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$days" -subj "/CN=sarcomm-etcd-ca" \
  -keyout ca.key -out ca.crt -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

sign() {  # NAME SUBJECT EXTENSIONS
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -subj "$2" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf '%s\n' "$3" >"$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
# Each member by name (TLS libraries match no wildcard over a one-label domain like sarcomm-etcd).
names=""
for ((i = 0; i < members; i++)); do
  for domain in sarcomm-etcd "sarcomm-etcd.$namespace.svc" "sarcomm-etcd.$namespace.svc.cluster.local"; do
    names="${names}DNS:sarcomm-etcd-$i.$domain,"
  done
done
sign peer "/CN=sarcomm-etcd" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=serverAuth,clientAuth
subjectAltName=${names}DNS:localhost,IP:127.0.0.1"
sign client "/CN=sarcomm-coordinator" "basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature
extendedKeyUsage=clientAuth"
echo "etcd-certs.sh: ca.crt, peer.crt/key, client.crt/key in $dir (CA key: ca.key, keep it offline)"

if [ "$apply" = 1 ]; then
  for who in peer client; do
    kubectl -n "$namespace" create secret generic "sarcomm-etcd-$who" \
      --from-file=ca.crt=ca.crt --from-file=tls.crt="$who.crt" --from-file=tls.key="$who.key"
  done
fi
