//! The in-process engine: ranks are threads of one process sharing a rendezvous.
//! Each operation is a round: every rank deposits its bytes, the last to arrive
//! publishes all of them, and all read the same published set. A rank that leaves its
//! closure (returns or panics) while others wait in a round, or a round that does not
//! complete within the timeout, makes the waiting ranks return an error. A split makes
//! a sub-group with a rendezvous of its own, registered with the world so that a rank
//! leaving is seen by every group it belongs to.

use super::group::{Collective, split_bytes, split_members};
use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug)]
struct Round {
    /// Rounds completed so far.
    generation: u64,
    /// Deposits of the round under way.
    slots: Vec<Option<Vec<u8>>>,
    /// The last completed round's deposits.
    published: Arc<Vec<Vec<u8>>>,
    /// Ranks whose closure has ended.
    exited: Vec<bool>,
}

/// The rendezvous of one group.
#[derive(Debug)]
struct Shared {
    round: Mutex<Round>,
    wake: Condvar,
    timeout: Duration,
    /// World ranks of the members, in group order.
    members: Vec<usize>,
}

impl Shared {
    fn new(members: Vec<usize>, timeout: Duration) -> Self {
        let size = members.len();
        Shared {
            round: Mutex::new(Round {
                generation: 0,
                slots: vec![None; size],
                published: Arc::new(Vec::new()),
                exited: vec![false; size],
            }),
            wake: Condvar::new(),
            timeout,
            members,
        }
    }

    /// Marks `world_rank` as exited if it is a member.
    fn mark_exited(&self, world_rank: usize) {
        if let Some(k) = self.members.iter().position(|&m| m == world_rank) {
            let mut round = self.round.lock().unwrap_or_else(|e| e.into_inner());
            round.exited[k] = true;
            self.wake.notify_all();
        }
    }
}

/// Every group of one in-process run: the sub-groups made by splits, keyed by
/// (parent group, split number, color), so that the members of a new group find the
/// same rendezvous.
#[derive(Debug, Default)]
struct Registry {
    groups: Mutex<HashMap<(usize, u64, u64), Arc<Shared>>>,
}

/// One rank's handle to an in-process group.
#[derive(Debug, Clone)]
pub struct InProcess {
    rank: usize,
    size: usize,
    shared: Arc<Shared>,
    registry: Arc<Registry>,
    /// Splits this handle has made (the same sequence on every member).
    splits: Arc<AtomicU64>,
}

impl Collective for InProcess {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.size
    }

    fn all_gather_bytes(&self, local: &[u8]) -> Result<Vec<Vec<u8>>> {
        let fail = |reason: String| Err(Error::Collective { reason });
        let mut round = self.shared.round.lock().unwrap_or_else(|e| e.into_inner());
        let generation = round.generation;
        round.slots[self.rank] = Some(local.to_vec());
        if round.slots.iter().all(Option::is_some) {
            let deposits = round.slots.iter_mut().map(|s| s.take().unwrap_or_default());
            round.published = Arc::new(deposits.collect());
            round.generation += 1;
            self.shared.wake.notify_all();
            return Ok(round.published.to_vec());
        }
        let deadline = Instant::now() + self.shared.timeout;
        while round.generation == generation {
            if let Some(gone) =
                (0..self.size).find(|&r| round.exited[r] && round.slots[r].is_none())
            {
                round.slots[self.rank] = None;
                return fail(format!(
                    "rank {gone} left while rank {} waited in a collective",
                    self.rank
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                round.slots[self.rank] = None;
                return fail(format!(
                    "rank {} waited {:?} for its peers in a collective (timeout)",
                    self.rank, self.shared.timeout
                ));
            }
            round = self
                .shared
                .wake
                .wait_timeout(round, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(round.published.to_vec())
    }

    fn split(&self, color: usize, key: usize) -> Result<Box<dyn Collective>> {
        let gathered = self.all_gather_bytes(&split_bytes(color, key))?;
        let members = split_members(&gathered, self.rank);
        let seq = self.splits.fetch_add(1, Ordering::Relaxed);
        let parent = Arc::as_ptr(&self.shared) as usize;
        let world_ranks: Vec<usize> = members.iter().map(|&m| self.shared.members[m]).collect();
        let shared = self
            .registry
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((parent, seq, color as u64))
            .or_insert_with(|| Arc::new(Shared::new(world_ranks, self.shared.timeout)))
            .clone();
        Ok(Box::new(InProcess {
            rank: members
                .iter()
                .position(|&m| m == self.rank)
                .expect("a rank is a member of its own color"),
            size: members.len(),
            shared,
            registry: self.registry.clone(),
            splits: Arc::new(AtomicU64::new(0)),
        }))
    }
}

/// Marks its world rank as exited in every group when dropped (normal return or panic).
struct ExitGuard<'a>(&'a InProcess);

impl Drop for ExitGuard<'_> {
    fn drop(&mut self) {
        let rank = self.0.rank;
        self.0.shared.mark_exited(rank);
        let groups = self
            .0
            .registry
            .groups
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        groups.values().for_each(|g| g.mark_exited(rank));
    }
}

/// Runs `f(comm)` on `world_size` threads, one per rank, and returns their results in
/// rank order. A collective that waits longer than `timeout` fails with an error; a
/// rank that panics makes its peers' collectives fail, then its panic is returned as
/// an [`Error::Collective`] for that rank.
pub fn run_in_process<T: Send>(
    world_size: usize,
    timeout: Duration,
    f: impl Fn(&InProcess) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let shared = Arc::new(Shared::new((0..world_size).collect(), timeout));
    let registry = Arc::new(Registry::default());
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..world_size)
            .map(|rank| {
                let comm = InProcess {
                    rank,
                    size: world_size,
                    shared: shared.clone(),
                    registry: registry.clone(),
                    splits: Arc::new(AtomicU64::new(0)),
                };
                let f = &f;
                scope.spawn(move || {
                    let _guard = ExitGuard(&comm);
                    f(&comm)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(rank, h)| {
                h.join().unwrap_or_else(|_| {
                    Err(Error::Collective {
                        reason: format!("rank {rank} panicked"),
                    })
                })
            })
            .collect()
    })
}
