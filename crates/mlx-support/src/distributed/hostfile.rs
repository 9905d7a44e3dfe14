//! The hostfile MLX's ring backend reads (`MLX_HOSTFILE`): JSON, one list
//! of `"ip:port"` addresses per rank, e.g.
//! `[["127.0.0.1:5531"], ["127.0.0.1:5532"]]`. Python's `mlx.launch` writes
//! the same format, so either launcher can start the other's programs.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use super::DistributedError;

/// The addresses of every rank of a job, in rank order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hostfile {
    ranks: Vec<Vec<SocketAddr>>,
}

impl Hostfile {
    /// A hostfile of `ranks`, each listening on its addresses (MLX opens one
    /// connection per address between neighbours; one each is usual).
    pub fn new(ranks: Vec<Vec<SocketAddr>>) -> Result<Hostfile, DistributedError> {
        Hostfile::checked(ranks).map_err(|reason| DistributedError::Hostfile {
            path: PathBuf::new(),
            reason,
        })
    }

    /// `n` ranks on 127.0.0.1, on ports `first_port`, `first_port + 1`, ….
    pub fn loopback(n: usize, first_port: u16) -> Result<Hostfile, DistributedError> {
        let ranks = (0..n)
            .map(|i| {
                let port = u16::try_from(usize::from(first_port) + i).map_err(|_| {
                    DistributedError::Hostfile {
                        path: PathBuf::new(),
                        reason: format!("{n} ports from {first_port} pass 65535"),
                    }
                })?;
                Ok(vec![SocketAddr::from(([127, 0, 0, 1], port))])
            })
            .collect::<Result<_, DistributedError>>()?;
        Hostfile::new(ranks)
    }

    /// Parses a hostfile's text; `path` names it in errors.
    pub fn parse(path: &Path, text: &str) -> Result<Hostfile, DistributedError> {
        let malformed = |reason: String| DistributedError::Hostfile {
            path: path.to_path_buf(),
            reason,
        };
        let lists: Vec<Vec<String>> = serde_json::from_str(text).map_err(|e| {
            malformed(format!(
                "expected a JSON list of lists of \"ip:port\" strings, one per rank: {e}"
            ))
        })?;
        let ranks = lists
            .iter()
            .enumerate()
            .map(|(rank, list)| {
                list.iter()
                    .map(|a| {
                        a.parse::<SocketAddr>().map_err(|_| {
                            malformed(format!("rank {rank}: {a:?} is not an \"ip:port\" address"))
                        })
                    })
                    .collect()
            })
            .collect::<Result<_, _>>()?;
        Hostfile::checked(ranks).map_err(malformed)
    }

    /// Reads and parses the hostfile at `path`.
    pub fn read(path: &Path) -> Result<Hostfile, DistributedError> {
        let text = std::fs::read_to_string(path).map_err(|e| DistributedError::Hostfile {
            path: path.to_path_buf(),
            reason: format!("cannot read it: {e}"),
        })?;
        Hostfile::parse(path, &text)
    }

    fn checked(ranks: Vec<Vec<SocketAddr>>) -> Result<Hostfile, String> {
        if ranks.is_empty() {
            return Err("it names no rank".to_owned());
        }
        let per_rank = ranks[0].len();
        for (rank, list) in ranks.iter().enumerate() {
            if list.is_empty() {
                return Err(format!("rank {rank} has no address"));
            }
            // MLX's ring needs as many connections to the left as to the
            // right; it says so only after connecting.
            if list.len() != per_rank {
                return Err(format!(
                    "rank {rank} has {} addresses, rank 0 has {per_rank}: every rank needs the same number",
                    list.len()
                ));
            }
        }
        Ok(Hostfile { ranks })
    }

    /// How many ranks the job has.
    pub fn size(&self) -> usize {
        self.ranks.len()
    }

    /// The addresses of `rank`.
    pub fn addresses(&self, rank: usize) -> Option<&[SocketAddr]> {
        self.ranks.get(rank).map(Vec::as_slice)
    }

    /// How many ranks share `rank`'s host (its first address's IP), itself
    /// included: what divides the machine's cores between them.
    pub fn ranks_on_host_of(&self, rank: usize) -> usize {
        let Some(ip) = self
            .ranks
            .get(rank)
            .and_then(|a| a.first())
            .map(SocketAddr::ip)
        else {
            return 1;
        };
        self.ranks
            .iter()
            .filter(|a| a.first().map(SocketAddr::ip) == Some(ip))
            .count()
    }

    /// The hostfile's JSON text.
    pub fn to_json(&self) -> String {
        let lists: Vec<Vec<String>> = self
            .ranks
            .iter()
            .map(|l| l.iter().map(ToString::to_string).collect())
            .collect();
        serde_json::to_string(&lists).unwrap_or_else(|_| "[]".to_owned())
    }

    /// Writes the hostfile to `path` (a sibling temporary file, then a
    /// rename, so a rank never reads half of it).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        let dir = path.parent().filter(|d| !d.as_os_str().is_empty());
        let dir = dir.unwrap_or(Path::new("."));
        let tmp = dir.join(format!(
            ".{}.tmp{}",
            path.file_name()
                .and_then(|n| n.to_str())
                .unwrap_or("hostfile"),
            std::process::id()
        ));
        std::fs::write(&tmp, self.to_json())?;
        std::fs::rename(&tmp, path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mlx_launchs_format_round_trips() {
        let text = r#"[["127.0.0.1:5531"], ["127.0.0.1:5532"]]"#;
        let h = Hostfile::parse(Path::new("h.json"), text).unwrap();
        assert_eq!(h.size(), 2);
        assert_eq!(h.addresses(1).unwrap()[0].port(), 5532);
        assert_eq!(
            Hostfile::parse(Path::new("h.json"), &h.to_json()).unwrap(),
            h
        );
        assert_eq!(h, Hostfile::loopback(2, 5531).unwrap());
        assert_eq!(h.ranks_on_host_of(1), 2);
        let two_hosts = r#"[["10.0.0.1:1"], ["10.0.0.2:1"], ["10.0.0.2:2"]]"#;
        let h = Hostfile::parse(Path::new("h.json"), two_hosts).unwrap();
        assert_eq!((h.ranks_on_host_of(0), h.ranks_on_host_of(2)), (1, 2));
    }

    #[test]
    fn malformed_hostfiles_say_what_is_wrong() {
        for (text, says) in [
            ("{}", "JSON list of lists"),
            ("[]", "no rank"),
            (r#"[["127.0.0.1:1"], []]"#, "rank 1 has no address"),
            (r#"[["localhost"]]"#, "rank 0: \"localhost\""),
            (
                r#"[["127.0.0.1:1"], ["127.0.0.1:2", "127.0.0.1:3"]]"#,
                "same number",
            ),
        ] {
            let err = Hostfile::parse(Path::new("bad.json"), text).unwrap_err();
            let message = err.to_string();
            assert!(message.contains(says), "{text}: {message}");
            assert!(message.contains("bad.json"), "{message}");
        }
        assert!(Hostfile::loopback(3, 65534).is_err());
    }
}
