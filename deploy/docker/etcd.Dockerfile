# etcd from Debian's `etcd-server` package (3.4), for the high-availability compose override
# (docker-compose.etcd.yml) on machines that cannot pull an etcd image from a registry.
# build-images.sh --etcd extracts the package's binary into the build context and builds this on
# the debootstrapped base (whose python3 runs the health check: etcd's own /health endpoint).
ARG BASE_IMAGE=sarcomm-base:bookworm
FROM ${BASE_IMAGE}
COPY etcd /usr/bin/
RUN groupadd --system --gid 10002 etcd \
 && useradd --system --uid 10002 --gid etcd --home-dir /var/lib/etcd --shell /usr/sbin/nologin etcd \
 && mkdir -p /var/lib/etcd && chown etcd:etcd /var/lib/etcd && chmod 700 /var/lib/etcd \
 && /usr/bin/etcd --version
USER etcd
WORKDIR /var/lib/etcd
EXPOSE 2379 2380
# Healthy once this member has a raft leader and the quorum (etcd's /health says "true").
HEALTHCHECK --interval=2s --timeout=3s --start-period=20s --retries=5 \
    CMD ["python3", "-c", "import json, sys, urllib.request; sys.exit(json.load(urllib.request.urlopen('http://127.0.0.1:2379/health', timeout=2)).get('health') != 'true')"]
ENTRYPOINT ["/usr/bin/etcd"]
