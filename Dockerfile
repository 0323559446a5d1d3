# syntax=docker/dockerfile:1
# Two images from one build: `docker build --target proxy -t mlscope-proxy .` and
# `docker build --target collector -t mlscope-collector .`.
#
# The runtime images hold the binary and the C libraries it links (glibc, libgcc_s) and nothing
# else: no shell, no package manager. They run as user 65532 and need no writable root file system
# (mount an emptyDir at /tmp for the proxy's SQLite file when not on PostgreSQL).
# `scripts/image` builds the same runtime layout from binaries built on the host, for machines
# without access to a registry's base images.

ARG RUST_VERSION=1.95.0

FROM docker.io/library/rust:${RUST_VERSION}-slim-bookworm AS build
# llvm-bolt lays the proxy's code out by the committed profile (scripts/release-build); where the
# package cannot be installed the proxy is built without it, correct and slower on the request path.
ARG BOLT_PACKAGE=bolt-22
RUN apt-get update \
 && { apt-get install -y --no-install-recommends "$BOLT_PACKAGE" \
      || echo "no $BOLT_PACKAGE here: mlscope-proxy is built without BOLT's layout"; } \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
# Dependencies first, so that a change to mlscope's sources does not rebuild them.
COPY Cargo.toml Cargo.lock ./
COPY scopes scopes
COPY server server
COPY collector collector
COPY migrations migrations
COPY scripts/release-flags scripts/release-build scripts/
COPY tests/Cargo.toml tests/Cargo.toml
COPY load-tests/Cargo.toml load-tests/Cargo.toml
# The workspace lists tests and load-tests; stubs stand in for their sources.
RUN mkdir -p tests/src load-tests/src \
 && echo "" > tests/src/lib.rs && echo "fn main() {}" > load-tests/src/main.rs && echo "" > load-tests/src/lib.rs \
 && scripts/release-build --locked mlscope-proxy mlscope-collector \
 && strip target/release/mlscope-proxy target/release/mlscope-collector

# What both runtime images share: the dynamic loader and the libraries the binaries link.
FROM docker.io/library/debian:bookworm-slim AS libs
RUN apt-get update \
 && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
RUN mkdir -p /rootfs/lib/x86_64-linux-gnu /rootfs/lib64 /rootfs/etc/ssl/certs /rootfs/tmp \
 && cp -L /lib/x86_64-linux-gnu/libc.so.6 /lib/x86_64-linux-gnu/libm.so.6 \
       /lib/x86_64-linux-gnu/libgcc_s.so.1 /rootfs/lib/x86_64-linux-gnu/ \
 && cp -L /lib64/ld-linux-x86-64.so.2 /rootfs/lib64/ \
 && cp /etc/ssl/certs/ca-certificates.crt /rootfs/etc/ssl/certs/ \
 && echo "nonroot:x:65532:65532:nonroot:/nonexistent:/sbin/nologin" > /rootfs/etc/passwd \
 && echo "nonroot:x:65532:" > /rootfs/etc/group \
 && chmod 1777 /rootfs/tmp

FROM scratch AS proxy
COPY --from=libs /rootfs/ /
COPY --from=build /src/target/release/mlscope-proxy /mlscope-proxy
USER 65532:65532
EXPOSE 5001 9464
ENTRYPOINT ["/mlscope-proxy"]
LABEL org.opencontainers.image.title="mlscope-proxy" \
      org.opencontainers.image.description="MLflow-compatible reverse proxy: scoped system metrics, write coalescing, artifact gateway, run health" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="0.1.0"

FROM scratch AS collector
COPY --from=libs /rootfs/ /
COPY --from=build /src/target/release/mlscope-collector /mlscope-collector
USER 65532:65532
ENTRYPOINT ["/mlscope-collector"]
LABEL org.opencontainers.image.title="mlscope-collector" \
      org.opencontainers.image.description="In-pod agent: what a training container really uses, under the mlscope scope contract" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="0.1.0"
