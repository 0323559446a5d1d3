//! Listen addresses as operators write them: `HOST:PORT`, where the host is an IP address or a
//! name (`localhost:5001`, `[::1]:5001`, `0.0.0.0:5001`). The syntax is checked with the rest of
//! the configuration; a name is resolved only when the proxy starts serving, so that
//! `--check-config` looks nothing up.

use std::fmt;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::str::FromStr;

use tokio::net::TcpListener;

/// How a listen address must be written, shown with every refusal.
const EXPECTED: &str = "expected HOST:PORT, e.g. 127.0.0.1:5001 or localhost:5001";

/// A `HOST:PORT` to listen on, not yet resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenAddr {
    /// An IP address (IPv6 without its brackets) or a host name.
    host: String,
    port: u16,
}

impl ListenAddr {
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Resolves the host and binds the first address it resolves to. Binding every address of
    /// a name would mean one accept loop per address; a proxy that must take both IPv4 and IPv6
    /// clients is given `[::]:PORT` (or one address per replica) instead.
    ///
    /// An address this host cannot bind (`::1` where IPv6 is off) is skipped for the next one;
    /// a port in use or not permitted is reported at once, not hidden behind another address.
    pub async fn bind(&self) -> io::Result<TcpListener> {
        let addresses: Vec<SocketAddr> = tokio::net::lookup_host((self.host.as_str(), self.port))
            .await
            .map_err(|e| io::Error::new(e.kind(), format!("the name does not resolve: {e}")))?
            .collect();
        let mut first_error = None;
        for address in &addresses {
            match TcpListener::bind(address).await {
                Ok(listener) => {
                    if addresses.len() > 1 {
                        tracing::info!(
                            name = %self,
                            bound = %address,
                            resolved = ?addresses,
                            "the name resolves to several addresses; listening on the first that binds"
                        );
                    }
                    return Ok(listener);
                }
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::AddrInUse | io::ErrorKind::PermissionDenied
                    ) =>
                {
                    return Err(io::Error::new(e.kind(), format!("{address}: {e}")));
                }
                Err(e) => {
                    first_error.get_or_insert(io::Error::new(e.kind(), format!("{address}: {e}")));
                }
            }
        }
        Err(first_error.unwrap_or_else(|| {
            io::Error::new(io::ErrorKind::NotFound, "the name resolves to no address")
        }))
    }
}

impl From<SocketAddr> for ListenAddr {
    fn from(address: SocketAddr) -> Self {
        Self {
            host: address.ip().to_string(),
            port: address.port(),
        }
    }
}

impl FromStr for ListenAddr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        if let Ok(address) = s.parse::<SocketAddr>() {
            return Ok(address.into());
        }
        let refuse = |why: &str| Err(format!("{why}; {EXPECTED}"));
        // A URL where an address belongs: say so, and what to write instead.
        if let Some((scheme, rest)) = s.split_once("://") {
            let address = rest.split('/').next().unwrap_or_default();
            return refuse(&format!(
                "a listen address takes no scheme ({scheme}://): write {address:?}"
            ));
        }
        let Some((host, port)) = s.rsplit_once(':') else {
            return refuse("no port");
        };
        let host = match host.strip_prefix('[') {
            Some(bracketed) => match bracketed.strip_suffix(']') {
                Some(ip) if ip.parse::<std::net::Ipv6Addr>().is_ok() => ip,
                _ => return refuse("brackets hold an IPv6 address, e.g. [::1]:5001"),
            },
            // `::1` alone parses as host `:` and port 1.
            None if host.contains(':') => {
                return refuse("an IPv6 address needs brackets, e.g. [::1]:5001")
            }
            None => host,
        };
        if host.is_empty() {
            return refuse("no host");
        }
        if port.is_empty() {
            return refuse("no port");
        }
        let Ok(port) = port.parse::<u16>() else {
            return refuse(&format!("port {port:?} is not a number from 0 to 65535"));
        };
        if !host
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'.' || b == b'_')
            && host.parse::<IpAddr>().is_err()
        {
            return refuse(&format!("{host:?} is not a host name"));
        }
        Ok(Self {
            host: host.to_owned(),
            port,
        })
    }
}

impl ListenAddr {
    /// A listen address read from the config file under `key`. Its refusal names the key and the
    /// value as written, since a file's value errors do not say which key they are about.
    pub fn from_file<'de, D: serde::Deserializer<'de>>(
        key: &str,
        d: D,
    ) -> Result<Option<Self>, D::Error> {
        let Some(text) = <Option<String> as serde::Deserialize>::deserialize(d)? else {
            return Ok(None);
        };
        text.parse()
            .map(Some)
            .map_err(|why| serde::de::Error::custom(format!("{key} = {text:?}: {why}")))
    }
}

impl fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_and_names_with_a_port_are_accepted() {
        for (written, shown) in [
            ("127.0.0.1:5001", "127.0.0.1:5001"),
            ("0.0.0.0:0", "0.0.0.0:0"),
            ("[::1]:5001", "[::1]:5001"),
            ("[::]:80", "[::]:80"),
            ("localhost:5001", "localhost:5001"),
            (
                "mlscope-proxy.internal:65535",
                "mlscope-proxy.internal:65535",
            ),
        ] {
            let address: ListenAddr = written.parse().unwrap_or_else(|e| panic!("{written}: {e}"));
            assert_eq!(address.to_string(), shown);
        }
    }

    #[test]
    fn values_that_are_not_host_and_port_are_refused_with_an_example() {
        for (written, why) in [
            ("localhost", "no port"),
            ("localhost:", "no port"),
            (":5001", "no host"),
            ("localhost:70000", "not a number from 0 to 65535"),
            ("localhost:http", "not a number from 0 to 65535"),
            ("::1", "needs brackets"),
            ("[localhost]:5001", "brackets hold an IPv6 address"),
            ("local host:5001", "not a host name"),
            (
                "http://127.0.0.1:5001",
                "takes no scheme (http://): write \"127.0.0.1:5001\"",
            ),
            ("https://[::1]:443/", "write \"[::1]:443\""),
        ] {
            let error = written.parse::<ListenAddr>().unwrap_err();
            assert!(error.contains(why), "{written}: {error}");
            assert!(error.ends_with(EXPECTED), "{written}: {error}");
            assert!(!error.contains('\n'), "{written}: {error}");
        }
    }

    #[tokio::test]
    async fn a_name_is_resolved_when_bound() {
        let listener = ListenAddr::from_str("localhost:0")
            .unwrap()
            .bind()
            .await
            .unwrap();
        assert!(listener.local_addr().unwrap().ip().is_loopback());
    }

    #[tokio::test]
    async fn a_name_that_does_not_resolve_is_reported_as_such() {
        // `.invalid` never resolves (RFC 2606).
        let error = ListenAddr::from_str("mlscope.invalid:5001")
            .unwrap()
            .bind()
            .await
            .unwrap_err();
        assert!(
            error.to_string().starts_with("the name does not resolve"),
            "{error}"
        );
    }

    #[tokio::test]
    async fn a_port_in_use_is_reported_not_skipped() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let address = ListenAddr::from(taken.local_addr().unwrap());
        let error = address.bind().await.unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::AddrInUse);
    }
}
