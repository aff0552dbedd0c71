//! How a restore avoids publishing output again, sans-IO: from what each sink stage
//! says it published after the restored checkpoint, an exact replay up to the end of
//! that output, or a refusal naming the stage, the output and why no replay can
//! reproduce it (unless duplicates are allowed).

use std::collections::BTreeMap;

use stillpoint_wire::{CheckpointId, SourceOffset, SourcePosition, TaskId};

/// Transactions a sink stage has published after a checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Published {
    /// Their checkpoints, oldest first (each once, however many tasks published it).
    pub checkpoints: Vec<CheckpointId>,
    /// The records they hold.
    pub records: u64,
    /// The source offsets the newest of them covers, when the sink recorded them: the
    /// engine then replays exactly up to them and drops that output instead of
    /// publishing it again. `None`: unknown, and such a restore is refused unless
    /// duplicates are allowed.
    pub covers: Option<Vec<SourcePosition>>,
}

/// Where each source task stops in a replay up to the end of published output.
pub type Bounds = BTreeMap<TaskId, SourceOffset>;

/// A replay up to the end of published output: every source stops at its bound until
/// a checkpoint taken there completes, and the sinks drop what they receive before
/// that checkpoint's barrier (it was published already).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replay {
    /// The newest checkpoint whose output is published.
    pub through: CheckpointId,
    /// Where each source task stops.
    pub bounds: Bounds,
    /// The published records the replay reproduces (not published again).
    pub records: u64,
}

/// How a restore deals with output the sinks published after its checkpoint.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RestorePlan {
    /// The exact replay, when there is published output to replay up to.
    pub replay: Option<Replay>,
    /// The newest checkpoint id the sinks know of (next ids must be greater: a
    /// transaction's name is its checkpoint id).
    pub newest_published: Option<CheckpointId>,
}

/// A restore that would publish output again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Republish {
    /// What is restored ("checkpoint N" or "from scratch").
    pub restored: String,
    /// The sink stage.
    pub stage: String,
    /// The output that would be published again.
    pub published: String,
    /// Why no exact replay can reproduce it.
    pub why: String,
}

/// The restore of `restored` (`None`: from scratch) with source tasks `sources`.
#[derive(Clone, Copy, Debug)]
pub struct RestoreQuestion<'a> {
    /// The checkpoint restored.
    pub restored: Option<CheckpointId>,
    /// Newer committed checkpoints were skipped as damaged, so a sink that cannot say
    /// what it published is presumed to have published them.
    pub fell_back: bool,
    /// Duplicates allowed: a restore that publishes output again is logged, not
    /// refused.
    pub allow: bool,
    /// The job's source tasks.
    pub sources: &'a [TaskId],
}

/// Plans the restore: `sinks` are the sink stages, each with what it says it
/// published after the restored checkpoint (`None`: it cannot say); `blocker` says,
/// when asked, why the dataflow cannot replay at all (a source that cannot stop at an
/// offset, an operator that is not deterministic).
pub fn plan_restore<E>(
    question: &RestoreQuestion<'_>,
    sinks: Vec<(String, Option<Published>)>,
    mut blocker: impl FnMut() -> Result<Option<String>, E>,
) -> Result<Result<RestorePlan, Republish>, E> {
    let from = question.restored.map_or_else(
        || "from scratch".to_owned(),
        |id| format!("checkpoint {}", id.get()),
    );
    let mut plan = RestorePlan::default();
    for (stage, published) in sinks {
        let (published, why) = match published {
            Some(published) if published.checkpoints.is_empty() => continue,
            Some(published) => {
                plan.newest_published = plan
                    .newest_published
                    .max(published.checkpoints.last().copied());
                match replay(&published, question.sources, &mut blocker)? {
                    Ok(replay) => {
                        plan.replay = Some(replay);
                        continue;
                    }
                    Err(why) => {
                        let ids: Vec<String> = published
                            .checkpoints
                            .iter()
                            .map(|id| id.get().to_string())
                            .collect();
                        let output = format!(
                            "the output of checkpoint(s) {} ({} records)",
                            ids.join(", "),
                            published.records
                        );
                        (output, why)
                    }
                }
            }
            None if question.fell_back => (
                "possibly the output of the newer checkpoints skipped as damaged".to_owned(),
                "the sink cannot say what it published".to_owned(),
            ),
            None => continue,
        };
        if question.allow {
            tracing::warn!(
                stage,
                restored = from,
                published,
                why,
                "restoring anyway (duplicates allowed): this output is published again"
            );
            continue;
        }
        return Ok(Err(Republish {
            restored: from,
            stage,
            published,
            why,
        }));
    }
    Ok(Ok(plan))
}

/// The exact replay of `published`, or why there is none.
fn replay<E>(
    published: &Published,
    sources: &[TaskId],
    blocker: &mut impl FnMut() -> Result<Option<String>, E>,
) -> Result<Result<Replay, String>, E> {
    let (Some(covers), Some(through)) = (&published.covers, published.checkpoints.last()) else {
        return Ok(Err(
            "the sink did not record the source offsets its output covers".to_owned(),
        ));
    };
    let bounds: Bounds = covers.iter().map(|p| (p.task, p.offset.clone())).collect();
    if !bounds.keys().eq(sources.iter()) {
        return Ok(Err(format!(
            "the published output covers source tasks {:?}, the job has {sources:?}",
            bounds.keys().map(|t| t.get()).collect::<Vec<_>>()
        )));
    }
    if let Some(why) = blocker()? {
        return Ok(Err(why));
    }
    Ok(Ok(Replay {
        through: *through,
        bounds,
        records: published.records,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn published(ids: &[u64], covers: Option<&[(u32, u64)]>) -> Published {
        Published {
            checkpoints: ids.iter().copied().map(CheckpointId).collect(),
            records: 7,
            covers: covers.map(|c| {
                c.iter()
                    .map(|(task, offset)| SourcePosition {
                        task: TaskId(*task),
                        offset: SourceOffset::from_u64(*offset),
                    })
                    .collect()
            }),
        }
    }

    fn plan(
        fell_back: bool,
        allow: bool,
        sinks: Vec<(String, Option<Published>)>,
        blocker: Option<&str>,
    ) -> Result<RestorePlan, Republish> {
        let question = RestoreQuestion {
            restored: Some(CheckpointId(3)),
            fell_back,
            allow,
            sources: &[TaskId(1), TaskId(2)],
        };
        plan_restore(&question, sinks, || Ok::<_, ()>(blocker.map(str::to_owned))).unwrap()
    }

    #[test]
    fn published_output_with_its_offsets_is_replayed_exactly_up_to_them() {
        let sinks = vec![(
            "out".to_owned(),
            Some(published(&[4, 5], Some(&[(1, 10), (2, 20)]))),
        )];
        let plan = plan(false, false, sinks, None).unwrap();
        assert_eq!(plan.newest_published, Some(CheckpointId(5)));
        let replay = plan.replay.unwrap();
        assert_eq!(replay.through, CheckpointId(5));
        assert_eq!(replay.bounds.len(), 2);
        assert_eq!(replay.records, 7);
    }

    #[test]
    fn output_no_replay_can_reproduce_is_refused_unless_duplicates_are_allowed() {
        let cases = [
            (published(&[4], None), None, "did not record"),
            (
                published(&[4], Some(&[(1, 10)])),
                None,
                "covers source tasks [1], the job has",
            ),
            (
                published(&[4], Some(&[(1, 10), (2, 20)])),
                Some("stage \"count\" is not deterministic"),
                "is not deterministic",
            ),
        ];
        for (output, blocker, why) in cases {
            let sinks = vec![("out".to_owned(), Some(output))];
            let refused = plan(false, false, sinks.clone(), blocker).unwrap_err();
            assert_eq!(refused.stage, "out");
            assert_eq!(refused.restored, "checkpoint 3");
            assert!(refused.why.contains(why), "{refused:?}");
            assert!(refused.published.contains("checkpoint(s) 4 (7 records)"));
            let allowed = plan(false, true, sinks, blocker).unwrap();
            assert_eq!(allowed.replay, None);
            assert_eq!(allowed.newest_published, Some(CheckpointId(4)));
        }
    }

    #[test]
    fn a_sink_that_cannot_say_is_presumed_to_have_published_only_after_a_fallback() {
        let sinks = vec![("out".to_owned(), None)];
        assert_eq!(
            plan(false, false, sinks.clone(), None),
            Ok(RestorePlan::default())
        );
        let refused = plan(true, false, sinks, None).unwrap_err();
        assert!(
            refused.published.contains("skipped as damaged"),
            "{refused:?}"
        );
        let nothing = vec![("out".to_owned(), Some(Published::default()))];
        assert_eq!(plan(true, false, nothing, None), Ok(RestorePlan::default()));
    }
}
