# Prometheus from Debian's `prometheus` package, for machines that cannot pull prom/prometheus.
# build-images.sh extracts the package's binaries into the build context (prometheus, promtool)
# and builds this on the debootstrapped base. It behaves like prom/prometheus: same user (nobody),
# data in /prometheus, config in /etc/prometheus, the binary as entrypoint.
ARG BASE_IMAGE=sarcomm-base:bookworm
FROM ${BASE_IMAGE}
COPY prometheus promtool /usr/bin/
RUN mkdir -p /prometheus /etc/prometheus && chown 65534:65534 /prometheus \
 && /usr/bin/prometheus --version
USER 65534:65534
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
