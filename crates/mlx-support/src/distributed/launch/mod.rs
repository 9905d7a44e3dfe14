//! Starting a job's ranks: what `cargo xtask launch` runs, and what tests
//! start their ranks with.
//!
//! A [`Launch`] writes the hostfile (MLX's format, so a program written for
//! Python's `mlx.launch` runs under it too), starts one process per rank
//! with `MLX_RANK` and `MLX_HOSTFILE` set — local ranks directly, ranks on
//! other hosts over `ssh` — forwards their output with a `[rank N]` prefix,
//! and ends every rank when one fails (after [`Launch::grace`] for the
//! others to exit by themselves, saying their own errors) or the deadline
//! passes, so that no rank is left waiting for a peer that is gone.
//!
//! A job asked to stop ([`Launch::stop_when`]: `mlx-launch` sets it on
//! SIGTERM and SIGINT) passes the signal on to every rank, gives them
//! [`Launch::grace`] to exit, then kills the rest. A rank on another host
//! runs under a small shell wrapper that reads signal names from its ssh
//! connection and ends the rank when the connection closes, so that not
//! even a launcher killed outright leaves a remote rank behind.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read};
use std::net::{SocketAddr, TcpListener, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::ChildStdin;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod stop;

use self::stop::{quote, remote_script, send_signal, signal_name};
use super::Hostfile;

/// Why a launch failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LaunchError {
    /// A host name that does not resolve to an IPv4 address.
    #[error("host {host:?} does not resolve to an IPv4 address")]
    Host { host: String },
    /// No free port could be found or the hostfile could not be written.
    #[error("cannot prepare the job: {0}")]
    Prepare(#[source] std::io::Error),
    /// A rank's process could not be started.
    #[error("rank {rank}: cannot start {program:?}: {source}")]
    Spawn {
        rank: usize,
        program: String,
        source: std::io::Error,
    },
    /// A rank failed; the others were ended. `ranks` holds every rank's
    /// exit and output.
    #[error("rank {rank} failed ({status}); every other rank was ended")]
    RankFailed {
        rank: usize,
        status: String,
        ranks: Vec<RankExit>,
    },
    /// The job ran past its deadline; every rank was ended.
    #[error("the job ran past {waited:?}; every rank was ended")]
    Timeout {
        waited: Duration,
        ranks: Vec<RankExit>,
    },
    /// The job was asked to stop ([`Launch::stop_when`]): `signal` was
    /// passed on to every rank, and those still running after the grace
    /// period were killed.
    #[error("stopped by signal {signal}; every rank was ended")]
    Stopped { signal: i32, ranks: Vec<RankExit> },
}

/// How one rank ended, and what it printed (stdout and stderr, in order
/// of arrival, without the prefix).
#[derive(Debug, Clone)]
pub struct RankExit {
    pub rank: usize,
    /// A rank the launcher ended reports the signal that ended it; `None`
    /// only when its status could not be read.
    pub status: Option<ExitStatus>,
    pub output: Vec<String>,
}

/// A job to start: `program args…` on each rank.
#[derive(Debug, Clone)]
pub struct Launch {
    hosts: Vec<String>,
    per_host: usize,
    program: OsString,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    timeout: Option<Duration>,
    starting_port: Option<u16>,
    echo: bool,
    hostfile_dir: Option<PathBuf>,
    per_rank: Vec<(usize, OsString, Vec<OsString>)>,
    stop: Option<Arc<AtomicUsize>>,
    grace: Duration,
}

impl Launch {
    /// `program` on `per_host` ranks on each of `hosts` (rank order: the
    /// hosts' order, then each host's ranks). `127.0.0.1` and `localhost`
    /// are started directly, other hosts over `ssh`, in the same working
    /// directory and with the same program path.
    pub fn new(hosts: &[&str], per_host: usize, program: impl Into<OsString>) -> Launch {
        Launch {
            hosts: hosts.iter().map(|h| (*h).to_owned()).collect(),
            per_host: per_host.max(1),
            program: program.into(),
            args: Vec::new(),
            envs: Vec::new(),
            timeout: None,
            starting_port: None,
            echo: true,
            hostfile_dir: None,
            per_rank: Vec::new(),
            stop: None,
            grace: Duration::from_secs(5),
        }
    }

    /// Arguments for every rank.
    pub fn args<I: IntoIterator<Item = S>, S: Into<OsString>>(mut self, args: I) -> Launch {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Runs `program args…` on `rank` instead of the job's program (one job
    /// of different programs, as `mpirun a : b` runs: a Rust rank beside a
    /// Python one, say).
    pub fn rank_command<I: IntoIterator<Item = S>, S: Into<OsString>>(
        mut self,
        rank: usize,
        program: impl Into<OsString>,
        args: I,
    ) -> Launch {
        let args = args.into_iter().map(Into::into).collect();
        self.per_rank.push((rank, program.into(), args));
        self
    }

    /// An environment variable for every rank.
    pub fn env(mut self, name: impl Into<OsString>, value: impl Into<OsString>) -> Launch {
        self.envs.push((name.into(), value.into()));
        self
    }

    /// Ends every rank when the job runs past `timeout` (no deadline by
    /// default).
    pub fn timeout(mut self, timeout: Duration) -> Launch {
        self.timeout = Some(timeout);
        self
    }

    /// Ports `port`, `port + 1`, … in rank order (as `mlx.launch
    /// --starting-port`). By default, local-only jobs take ports the OS
    /// reports free and jobs with remote hosts start at 32323.
    pub fn starting_port(mut self, port: u16) -> Launch {
        self.starting_port = Some(port);
        self
    }

    /// Whether to print the ranks' lines with a `[rank N]` prefix (yes by
    /// default; they are kept in [`RankExit::output`] either way).
    pub fn echo(mut self, echo: bool) -> Launch {
        self.echo = echo;
        self
    }

    /// Stops the job once `signal` holds a signal number (non-zero): the
    /// number is passed on to every rank, as `kill` would send it, and the
    /// run returns [`LaunchError::Stopped`]. What `signal-hook`'s
    /// `flag::register_usize` sets from a handler is such a value.
    pub fn stop_when(mut self, signal: Arc<AtomicUsize>) -> Launch {
        self.stop = Some(signal);
        self
    }

    /// How long ranks asked to stop, or still running when another rank
    /// failed, may take to exit before they are killed (default 5 s).
    pub fn grace(mut self, grace: Duration) -> Launch {
        self.grace = grace;
        self
    }

    /// Where to write the hostfile (a temporary folder by default).
    pub fn hostfile_dir(mut self, dir: impl Into<PathBuf>) -> Launch {
        self.hostfile_dir = Some(dir.into());
        self
    }

    fn is_local(host: &str) -> bool {
        matches!(host, "127.0.0.1" | "localhost")
    }

    /// The hostfile for this job.
    pub fn hostfile(&self) -> Result<Hostfile, LaunchError> {
        let all_local = self.hosts.iter().all(|h| Launch::is_local(h));
        let mut ranks = Vec::new();
        let mut port = self.starting_port.unwrap_or(32323);
        for host in &self.hosts {
            let ip = (host.as_str(), 0)
                .to_socket_addrs()
                .ok()
                .and_then(|mut a| a.find(SocketAddr::is_ipv4))
                .ok_or_else(|| LaunchError::Host { host: host.clone() })?
                .ip();
            for _ in 0..self.per_host {
                let p = if all_local && self.starting_port.is_none() {
                    free_port().map_err(LaunchError::Prepare)?
                } else {
                    let p = port;
                    port = port.wrapping_add(1);
                    p
                };
                ranks.push(vec![SocketAddr::new(ip, p)]);
            }
        }
        Hostfile::new(ranks).map_err(|e| LaunchError::Prepare(std::io::Error::other(e)))
    }

    /// Starts every rank and waits for all of them. Ok when every rank
    /// exited with success.
    pub fn run(&self) -> Result<Vec<RankExit>, LaunchError> {
        let hostfile = self.hostfile()?;
        let tmp;
        let dir = match &self.hostfile_dir {
            Some(d) => d.clone(),
            None => {
                tmp = tempfile::tempdir().map_err(LaunchError::Prepare)?;
                tmp.path().to_path_buf()
            }
        };
        let path = dir.join("hostfile.json");
        hostfile.write(&path).map_err(LaunchError::Prepare)?;
        let mut job = Job::default();
        for rank in 0..hostfile.size() {
            let host = &self.hosts[rank / self.per_host];
            let command = self.command(host, rank, &path, &hostfile);
            let remote = !Launch::is_local(host);
            if let Err(e) = job.spawn(rank, command, remote, self.echo) {
                let _ = job.end_all();
                return Err(LaunchError::Spawn {
                    rank,
                    program: self.program.to_string_lossy().into_owned(),
                    source: e,
                });
            }
        }
        job.wait(self.timeout, self.stop.as_deref(), self.grace)
    }

    fn command(&self, host: &str, rank: usize, hostfile: &Path, h: &Hostfile) -> Command {
        let (program, args) = match self.per_rank.iter().rev().find(|(r, ..)| *r == rank) {
            Some((_, program, args)) => (program, args),
            None => (&self.program, &self.args),
        };
        if Launch::is_local(host) {
            let mut c = Command::new(program);
            c.args(args)
                .env("MLX_RANK", rank.to_string())
                .env("MLX_HOSTFILE", hostfile);
            // Ranks on one machine share its cores. OpenBLAS threads that
            // wait for a core another rank holds stall every product (a
            // two-rank pipeline on two cores ran at a third of its speed);
            // each rank gets its share unless the caller chose.
            if self.per_host > 1 && std::env::var_os("OPENBLAS_NUM_THREADS").is_none() {
                let cores = std::thread::available_parallelism().map_or(1, usize::from);
                c.env(
                    "OPENBLAS_NUM_THREADS",
                    (cores / self.per_host).max(1).to_string(),
                );
            }
            for (k, v) in &self.envs {
                c.env(k, v);
            }
            return c;
        }
        // The remote side gets the hostfile's text and writes its own copy:
        // the local file is not there.
        let remote_file = format!("/tmp/mlx-lowmem-hostfile-{}.json", std::process::id());
        let cwd = std::env::current_dir().unwrap_or_default();
        let mut envs = vec![
            (OsString::from("MLX_RANK"), OsString::from(rank.to_string())),
            (OsString::from("MLX_HOSTFILE"), OsString::from(&remote_file)),
        ];
        envs.extend(self.envs.iter().cloned());
        let setup = format!(
            "printf '%s' {} > {remote_file} && cd {}",
            quote(h.to_json().as_ref()),
            quote(cwd.as_os_str()),
        );
        let script = remote_script(&setup, &envs, program, args);
        let mut c = Command::new("ssh");
        // The login shell may be any; the wrapper is POSIX sh.
        c.arg(host)
            .arg(format!("exec sh -c {}", quote(script.as_ref())));
        c
    }
}

/// A port the OS reports free on 127.0.0.1 now.
fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[derive(Default)]
struct Job {
    children: Vec<(usize, Child)>,
    /// A remote rank's connection: where its signals are written (see
    /// [`remote_script`]); `None` for a local rank.
    signal_lines: Vec<Option<ChildStdin>>,
    outputs: Vec<Arc<Mutex<Vec<String>>>>,
    readers: Vec<std::thread::JoinHandle<()>>,
}

impl Job {
    fn spawn(
        &mut self,
        rank: usize,
        mut command: Command,
        remote: bool,
        echo: bool,
    ) -> std::io::Result<()> {
        let mut child = command
            .stdin(if remote {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let lines = Arc::new(Mutex::new(Vec::new()));
        let streams: [Option<Box<dyn Read + Send>>; 2] = [
            child
                .stdout
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
            child
                .stderr
                .take()
                .map(|s| Box::new(s) as Box<dyn Read + Send>),
        ];
        for (is_err, stream) in streams.into_iter().enumerate() {
            let Some(stream) = stream else { continue };
            let lines = Arc::clone(&lines);
            self.readers.push(std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if echo {
                        if is_err == 1 {
                            eprintln!("[rank {rank}] {line}");
                        } else {
                            println!("[rank {rank}] {line}");
                        }
                    }
                    if let Ok(mut l) = lines.lock() {
                        l.push(line);
                    }
                }
            }));
        }
        self.signal_lines.push(child.stdin.take());
        self.children.push((rank, child));
        self.outputs.push(lines);
        Ok(())
    }

    /// Kills every rank still running and reaps all of them; each one's
    /// exit status (a rank that had already exited keeps its own; one
    /// killed here reports the signal).
    fn end_all(&mut self) -> Vec<Option<ExitStatus>> {
        // A remote rank's wrapper kills its rank when its input closes.
        for line in &mut self.signal_lines {
            line.take();
        }
        self.children
            .iter_mut()
            .map(|(_, child)| {
                let _ = child.kill();
                child.wait().ok()
            })
            .collect()
    }

    /// Sends `signal` to every rank still running: to a local rank's
    /// process, as a line to a remote rank's wrapper.
    fn signal_all(&mut self, signal: i32, statuses: &[Option<ExitStatus>]) {
        for (i, (_, child)) in self.children.iter_mut().enumerate() {
            if statuses[i].is_some() {
                continue;
            }
            if let Some(line) = &mut self.signal_lines[i] {
                use std::io::Write;
                let _ = writeln!(line, "{}", signal_name(signal)).and_then(|()| line.flush());
            } else {
                send_signal(child, signal);
            }
        }
    }

    /// Stops the job: `signal` to every rank, then up to `grace` for them
    /// to exit, then the rest killed. Every rank's status.
    fn stop(
        &mut self,
        signal: i32,
        grace: Duration,
        mut statuses: Vec<Option<ExitStatus>>,
    ) -> Vec<Option<ExitStatus>> {
        self.signal_all(signal, &statuses);
        self.settle(grace, &mut statuses);
        let ended = self.end_all();
        merge(statuses, ended)
    }

    /// Waits up to `grace` for the ranks still running to exit by
    /// themselves, recording each exit in `statuses`.
    fn settle(&mut self, grace: Duration, statuses: &mut [Option<ExitStatus>]) {
        let start = Instant::now();
        while statuses.iter().any(Option::is_none) && start.elapsed() < grace {
            for (i, (_, child)) in self.children.iter_mut().enumerate() {
                if statuses[i].is_none() {
                    if let Ok(Some(status)) = child.try_wait() {
                        statuses[i] = Some(status);
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn wait(
        mut self,
        timeout: Option<Duration>,
        stop: Option<&AtomicUsize>,
        grace: Duration,
    ) -> Result<Vec<RankExit>, LaunchError> {
        let start = Instant::now();
        let mut statuses: Vec<Option<ExitStatus>> = vec![None; self.children.len()];
        let failed = loop {
            let signal = stop.map_or(0, |s| s.load(Ordering::SeqCst));
            if signal != 0 {
                let signal = i32::try_from(signal).unwrap_or(i32::MAX);
                let statuses = self.stop(signal, grace, statuses);
                return Err(LaunchError::Stopped {
                    signal,
                    ranks: self.exits(statuses),
                });
            }
            let mut failed = None;
            for (i, (rank, child)) in self.children.iter_mut().enumerate() {
                if statuses[i].is_none() {
                    if let Ok(Some(status)) = child.try_wait() {
                        statuses[i] = Some(status);
                        if !status.success() && failed.is_none() {
                            failed = Some((*rank, status));
                        }
                    }
                }
            }
            if failed.is_some() || statuses.iter().all(Option::is_some) {
                break failed;
            }
            if timeout.is_some_and(|t| start.elapsed() > t) {
                let ended = self.end_all();
                let statuses = merge(statuses, ended);
                return Err(LaunchError::Timeout {
                    waited: start.elapsed(),
                    ranks: self.exits(statuses),
                });
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // The peers of a failed rank usually fail at once too, each with
        // its own half of the cause (a handshake that disagrees fails on
        // every rank): they get the grace period to say it and exit before
        // the rest are killed. A rank that exited between the last look and
        // now keeps its own status.
        if failed.is_some() {
            self.settle(grace, &mut statuses);
        }
        let ended = self.end_all();
        let ranks = self.exits(merge(statuses, ended));
        match failed {
            Some((rank, status)) => Err(LaunchError::RankFailed {
                rank,
                status: status.to_string(),
                ranks,
            }),
            None => Ok(ranks),
        }
    }

    fn exits(&mut self, statuses: Vec<Option<ExitStatus>>) -> Vec<RankExit> {
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
        self.children
            .iter()
            .zip(statuses)
            .zip(&self.outputs)
            .map(|(((rank, _), status), lines)| RankExit {
                rank: *rank,
                status,
                output: lines.lock().map(|l| l.clone()).unwrap_or_default(),
            })
            .collect()
    }
}

/// The statuses seen while waiting, completed by those read when the job
/// was ended.
fn merge(seen: Vec<Option<ExitStatus>>, ended: Vec<Option<ExitStatus>>) -> Vec<Option<ExitStatus>> {
    seen.into_iter().zip(ended).map(|(s, e)| s.or(e)).collect()
}

impl Drop for Job {
    fn drop(&mut self) {
        // No rank outlives its launcher, whatever path left it.
        let _ = self.end_all();
    }
}
