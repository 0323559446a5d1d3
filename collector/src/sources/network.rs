//! Pod network traffic from `/proc/net/dev` (the network namespace, shared by the pod's
//! containers), loopback excluded, in megabytes since the collector started — MLflow's
//! semantics for `network_receive_megabytes` / `network_transmit_megabytes`.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::path::PathBuf;

use super::files::OpenFiles;
use super::Named;

/// Received and transmitted bytes of one interface.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    pub received: u64,
    pub transmitted: u64,
}

/// Per-interface counters, `lo` left out. Lines are `name: rx_bytes rx_packets ... (8 receive
/// fields) tx_bytes ...`; the name ends at the last `:` as in psutil.
pub fn parse_net_dev(text: &str) -> BTreeMap<String, Counters> {
    text.lines()
        .skip(2)
        .filter_map(|line| {
            let (name, rest) = line.rsplit_once(':')?;
            let name = name.trim();
            if name == "lo" {
                return None;
            }
            let fields: Vec<u64> = rest
                .split_whitespace()
                .map(|f| f.parse().ok())
                .collect::<Option<_>>()?;
            Some((
                name.to_owned(),
                Counters {
                    received: *fields.first()?,
                    transmitted: *fields.get(8)?,
                },
            ))
        })
        .collect()
}

/// Adds up traffic since start across interfaces. A counter that goes back (an interface that
/// was recreated, a 32-bit wrap) starts a new count instead of making the total go back.
#[derive(Debug)]
pub struct NetworkSource {
    path: PathBuf,
    files: OpenFiles,
    last: BTreeMap<String, Counters>,
    total: Counters,
}

impl NetworkSource {
    pub fn new(proc_root: PathBuf) -> Self {
        let path = proc_root.join("net/dev");
        let mut files = OpenFiles::default();
        let last = files.read(&path).map(parse_net_dev).unwrap_or_default();
        NetworkSource {
            path,
            files,
            last,
            total: Counters::default(),
        }
    }

    /// Folds a new reading into the totals.
    pub fn update(&mut self, now: BTreeMap<String, Counters>) {
        for (name, counters) in &now {
            let before = self.last.get(name).copied().unwrap_or_default();
            let grown = |now: u64, before: u64| if now >= before { now - before } else { now };
            self.total.received += grown(counters.received, before.received);
            self.total.transmitted += grown(counters.transmitted, before.transmitted);
        }
        self.last = now;
    }

    pub fn total(&self) -> Counters {
        self.total
    }

    pub fn sample(&mut self, out: &mut Vec<Named>) {
        let Some(now) = self.files.read(&self.path).map(parse_net_dev) else {
            return;
        };
        self.update(now);
        out.push((
            Cow::Borrowed("network_receive_megabytes"),
            self.total.received as f64 / 1e6,
        ));
        out.push((
            Cow::Borrowed("network_transmit_megabytes"),
            self.total.transmitted as f64 / 1e6,
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEV: &str = "Inter-|   Receive                                                |  Transmit\n \
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    \
lo: 6199229902  218285    0    0    0     0          0         0 6199229902  218285    0    0    0     0       0          0\n  \
eth0: 1000   26861    0    0    0     0          0         0  2000   16549    0    0    0     0       0          0\n\
veth:x: 10 1 0 0 0 0 0 0 20 1 0 0 0 0 0 0\n";

    #[test]
    fn loopback_is_excluded_and_names_end_at_the_last_colon() {
        let counters = parse_net_dev(DEV);
        assert_eq!(counters.keys().collect::<Vec<_>>(), ["eth0", "veth:x"]);
        assert_eq!(
            counters["eth0"],
            Counters {
                received: 1000,
                transmitted: 2000
            }
        );
    }

    #[test]
    fn totals_count_from_start_and_survive_a_counter_reset() {
        let mut source = NetworkSource {
            path: PathBuf::new(),
            files: OpenFiles::default(),
            last: parse_net_dev(DEV),
            total: Counters::default(),
        };
        source.update(parse_net_dev(&DEV.replace("eth0: 1000", "eth0: 1500")));
        assert_eq!(
            source.total(),
            Counters {
                received: 500,
                transmitted: 0
            }
        );
        // eth0 was recreated: its counter restarts at 300.
        source.update(parse_net_dev(&DEV.replace("eth0: 1000", "eth0: 300")));
        assert_eq!(
            source.total(),
            Counters {
                received: 800,
                transmitted: 0
            }
        );
        // An interface that appears after start counts from zero.
        source.update(parse_net_dev(&format!(
            "{}eth1: 7 0 0 0 0 0 0 0 9 0 0 0 0 0 0 0\n",
            DEV.replace("eth0: 1000", "eth0: 300")
        )));
        assert_eq!(
            source.total(),
            Counters {
                received: 807,
                transmitted: 9
            }
        );
    }
}
