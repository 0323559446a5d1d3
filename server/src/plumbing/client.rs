//! Which client a request comes from, for the limits one client may hold (bodies under
//! inspection, upload slots, its share of MLflow's writes): its source address, or, when that is
//! a trusted gateway in front of the proxy (`--trusted-proxies`), the address the gateway says it
//! served (`X-Forwarded-For`, read from the right, skipping trusted hops). Without trusted
//! proxies a client cannot claim another address: the header is ignored. For the write share a
//! client is first its credential ([`crate::plumbing::credential::Credential`]).

use std::net::IpAddr;

use http::HeaderMap;

/// The peer of a request's connection (axum's `ConnectInfo`), or `0.0.0.0:0` where there is none
/// (a request built in a test, or routed without a connection).
pub(crate) fn peer_of(extensions: &http::Extensions) -> std::net::SocketAddr {
    extensions
        .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
        .map_or(std::net::SocketAddr::from(([0, 0, 0, 0], 0)), |c| c.0)
}

/// Who the clients are, as given (see [`crate::plumbing::settings`]); `None`: not given here.
#[derive(Debug, Clone, Default, clap::Args, serde::Deserialize)]
pub(crate) struct ClientOptions {
    /// Addresses or networks of gateways in front of the proxy (e.g. 10.0.0.0/8,fd00::/8): a
    /// request from one is counted against the client its X-Forwarded-For names, for the share
    /// of inspected bodies and upload slots one client may hold [default: none; every client is
    /// its source address].
    #[arg(long, env = "MLSCOPE_TRUSTED_PROXIES", value_name = "NETWORKS")]
    pub trusted_proxies: Option<String>,
}

impl ClientOptions {
    /// The trusted gateways (none unless given).
    pub(crate) fn resolve(self) -> Result<TrustedProxies, String> {
        match self.trusted_proxies {
            Some(networks) => {
                TrustedProxies::parse(&networks).map_err(|e| format!("trusted-proxies: {e}"))
            }
            None => Ok(TrustedProxies::default()),
        }
    }
}

/// A set of networks, `address/prefix-length`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TrustedProxies(Vec<(IpAddr, u8)>);

impl TrustedProxies {
    /// `10.0.0.0/8, 192.168.1.7, fd00::/8`: addresses or CIDR networks, comma-separated.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut networks = Vec::new();
        for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            let (address, prefix) = item.split_once('/').unwrap_or((item, ""));
            let address: IpAddr = address.parse().map_err(|_| {
                format!("{item:?} is not an IP address or network (e.g. 10.0.0.0/8)")
            })?;
            let max = if address.is_ipv4() { 32 } else { 128 };
            let prefix = if prefix.is_empty() {
                max
            } else {
                prefix
                    .parse::<u8>()
                    .ok()
                    .filter(|p| *p <= max)
                    .ok_or_else(|| format!("{item:?}: the prefix length must be 0 to {max}"))?
            };
            networks.push((address, prefix));
        }
        Ok(Self(networks))
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    fn contains(&self, address: IpAddr) -> bool {
        let address = canonical(address);
        self.0
            .iter()
            .any(|(network, prefix)| match (canonical(*network), address) {
                (IpAddr::V4(n), IpAddr::V4(a)) => {
                    let mask = u32::MAX.checked_shl(32 - u32::from(*prefix)).unwrap_or(0);
                    u32::from(n) & mask == u32::from(a) & mask
                }
                (IpAddr::V6(n), IpAddr::V6(a)) => {
                    let mask = u128::MAX.checked_shl(128 - u32::from(*prefix)).unwrap_or(0);
                    u128::from(n) & mask == u128::from(a) & mask
                }
                _ => false,
            })
    }

    /// The client of a request from `peer`: `peer` itself, unless it is trusted; then the last
    /// untrusted address of `X-Forwarded-For` (the one the trusted chain received it from).
    pub fn client(&self, peer: IpAddr, headers: &HeaderMap) -> IpAddr {
        if !self.contains(peer) {
            return canonical(peer);
        }
        let hops = headers
            .get_all("x-forwarded-for")
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .map(str::trim)
            .collect::<Vec<_>>();
        let mut client = canonical(peer);
        for hop in hops.iter().rev() {
            match hop.parse::<IpAddr>() {
                Ok(address) => {
                    client = canonical(address);
                    if !self.contains(address) {
                        break;
                    }
                }
                // Garbage where an address should be: the last trusted hop is the client.
                Err(_) => break,
            }
        }
        client
    }
}

/// IPv4 addresses mapped into IPv6 (`::ffff:10.0.0.1`) as IPv4.
fn canonical(address: IpAddr) -> IpAddr {
    match address {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(address, IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(xff: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert("x-forwarded-for", xff.parse().unwrap());
        h
    }

    #[test]
    fn the_client_is_the_peer_unless_a_trusted_gateway_names_it() {
        let ip = |s: &str| s.parse::<IpAddr>().unwrap();
        let none = TrustedProxies::default();
        assert_eq!(
            none.client(ip("10.0.0.5"), &headers("1.2.3.4")),
            ip("10.0.0.5")
        );
        let gateways = TrustedProxies::parse("10.0.0.0/24, fd00::1").unwrap();
        assert_eq!(
            gateways.client(ip("10.0.0.5"), &headers("1.2.3.4")),
            ip("1.2.3.4")
        );
        // A client cannot hide behind addresses it writes itself: the rightmost untrusted wins.
        assert_eq!(
            gateways.client(ip("10.0.0.5"), &headers("6.6.6.6, 1.2.3.4, 10.0.0.9")),
            ip("1.2.3.4")
        );
        assert_eq!(
            gateways.client(ip("::ffff:10.0.0.5"), &headers("1.2.3.4")),
            ip("1.2.3.4")
        );
        assert_eq!(
            gateways.client(ip("fd00::1"), &headers("garbage")),
            ip("fd00::1")
        );
        assert_eq!(
            gateways.client(ip("10.0.1.5"), &headers("1.2.3.4")),
            ip("10.0.1.5")
        );
        assert_eq!(
            gateways.client(ip("10.0.0.5"), &HeaderMap::new()),
            ip("10.0.0.5")
        );
        for bad in ["10.0.0.0/33", "nope", "::1/129"] {
            assert!(TrustedProxies::parse(bad).is_err(), "{bad}");
        }
        assert!(TrustedProxies::parse("").unwrap().is_empty());
    }
}
