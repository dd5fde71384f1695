//! The Profile: one measured training step cut into units (docs/formats.md).

use crate::action::Action;
use crate::error::{CoreError, Result};
use crate::versioned::read_versioned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

pub const PROFILE_FORMAT: &str = "tensorplace.profile";
pub const PROFILE_VERSION: u32 = 1;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConstantMemory {
    #[serde(default)]
    pub parameters: u64,
    #[serde(default)]
    pub optimizer_state: u64,
    #[serde(default)]
    pub inputs: u64,
    #[serde(default)]
    pub workspace: u64,
}

impl ConstantMemory {
    pub fn total(&self) -> u64 {
        self.parameters + self.optimizer_state + self.inputs + self.workspace
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    #[serde(default)]
    pub peak_bytes: Option<u64>,
    #[serde(default)]
    pub step_time: Option<f64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Unit {
    pub name: String,
    #[serde(default = "default_kind")]
    pub kind: String,
    #[serde(default)]
    pub inputs: Vec<i64>,
    #[serde(default)]
    pub model_inputs: Vec<i64>,
    pub fwd_time: f64,
    pub bwd_time: f64,
    pub act_bytes: i64,
    #[serde(default)]
    pub output_bytes: i64,
    #[serde(default = "default_true")]
    pub output_saved: bool,
    #[serde(default)]
    pub read_by: Vec<i64>,
    #[serde(default)]
    pub held_input_bytes: i64,
    /// The units among `inputs` some value of which this unit reads from their saved activations
    /// (a replay of this unit needs those activations). Absent: the inputs whose `output_saved`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_inputs: Option<Vec<i64>>,
    #[serde(default)]
    pub fwd_transient_bytes: i64,
    #[serde(default)]
    pub bwd_transient_bytes: i64,
    #[serde(default)]
    pub grad_bytes: i64,
    /// Memory a replay of the unit uses beyond its `act_bytes` (measured by replaying it).
    /// Absent: `output_bytes` if the output is not saved, plus `fwd_transient_bytes`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_transient_bytes: Option<i64>,
    /// Bytes of the activations that the forward's own code still references after the unit's
    /// last forward reader, until the end of forward stage `lingering_until` (the number of units:
    /// after the forward). Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lingering_bytes: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lingering_until: Option<i64>,
    /// The last forward stage at whose start the forward's own code still references some of
    /// the unit's activations, when that is before its last forward reader (the replay step: a
    /// value only its saver reads, a unit's own intermediates). A swapped unit's bytes stay at
    /// least until then, a recomputed unit's until then, not until its last forward reader.
    /// Absent: its last forward reader.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub forward_held_until: Option<i64>,
    /// The values (ids as in `held_values` / `saved_values`) of those lingering bytes that some
    /// unit reads as an input, as `[value id, bytes]`: while a checkpoint segment holds such a
    /// value for its replay, the forward's reference to it costs nothing more. Absent: none known.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lingering_values: Option<Vec<[i64; 2]>>,
    /// The part of `held_input_bytes` that comes from earlier units' unsaved values, as
    /// `[producer, bytes]` pairs. When the producer is recomputed in the same run of consecutive
    /// recomputed units, the run's replay regenerates the value and nothing is held for it.
    /// Absent: all held inputs are held whatever the plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_from: Option<Vec<[i64; 2]>>,
    /// Bytes of saved values this unit reads from earlier units, as `[producer, bytes]` pairs
    /// (a part of the producer's `act_bytes`). A recomputed unit holds those of a producer
    /// recomputed in another checkpoint segment, as torch.utils.checkpoint holds its inputs.
    /// Absent: such values are not charged to the reader.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_from: Option<Vec<[i64; 2]>>,
    /// `held_from` and `saved_from` one value (storage) at a time, as `[producer, value id,
    /// bytes]`: a value read by several units of one checkpoint segment has the same id, so the
    /// segment holds it once, while two values of one producer are both held. Absent (on any
    /// unit): a segment holds each producer's values once, the first reader's bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_values: Option<Vec<[i64; 3]>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub saved_values: Option<Vec<[i64; 3]>>,
    /// Bytes of the parameters the optimizer updates that this unit is the first to use in the
    /// forward (a plan may keep them on the host from the optimizer step to this unit's next
    /// forward). Absent: none (they stay in `memory.parameters`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub param_bytes: Option<i64>,
    /// Bytes of the optimizer state of those parameters (a plan may keep them on the host
    /// between optimizer steps). Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_state_bytes: Option<i64>,
    /// Seconds of the optimizer step over those parameters (its part of the optimizer stage).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_time: Option<f64>,
    /// Memory that part of the optimizer step allocates while it runs (freed at its end).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer_transient_bytes: Option<i64>,
    /// The unit's segment (its module call and the glue after it) draws random numbers: a
    /// checkpoint segment that contains it keeps the generators' state for its replay
    /// (`rng_state_bytes` of the profile). Absent: false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub random: bool,
    /// False: the executor cannot replay the unit (the profiler's replay step found code in its
    /// segment that it cannot record, such as a custom autograd Function applied outside a
    /// module). A plan never recomputes it: the cost model and the planner retain it where a plan
    /// says recompute. Absent: true.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recomputable: Option<bool>,
    /// Saved tensors its segment makes (of any owner): the executor's hooks handle each one when
    /// the unit's action moves them (docs/cost-model.md, "Host time"). Absent: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub packs: Option<u32>,
    /// Storages of its activations (each swapped storage is one copy out and back). Absent: 1
    /// when it has activations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub act_storages: Option<u32>,
    /// Glue calls of its segment (torch calls between its module call and the next unit's) with
    /// tensor outputs. Absent: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub glue_ops: Option<u32>,
    /// The units `[first, last]` of the innermost module call that holds all of its glue (and runs
    /// no glue before its first unit): a checkpoint segment that contains them is replayed by
    /// calling that module again; one that does not is tracked. `[-1, -1]`: no module call does.
    /// Absent: its segment has no glue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub glue_scope: Option<[i64; 2]>,
    /// Host seconds to issue its forward and backward stages (on a GPU, where kernels run
    /// asynchronously; docs/cost-model.md, "Host time"). Absent (a CPU profile): the host runs
    /// the kernels itself and the stage times already contain its work.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fwd_host_time: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bwd_host_time: Option<f64>,
    /// Single allocation requests larger than the profile's largest unit output that its forward
    /// stage, its backward stage and its replay made, in order (cuDNN workspaces, say): the
    /// allocation sequence gives them their own blocks (docs/cost-model.md, "Reserved memory").
    /// Absent: none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fwd_large_allocs: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bwd_large_allocs: Option<Vec<u64>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_large_allocs: Option<Vec<u64>>,
    /// Peak of the loss's backward (from the backward call to this unit's first backward node:
    /// the first backward stage's unit), beyond what the cost model counts before the stage's
    /// gradients; it runs before the stage's prefetches and replays. Absent: 0 (profiles that
    /// count it in `bwd_transient_bytes`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_transient_bytes: Option<i64>,
    /// The highest memory at the start of one of the unit's backward nodes, beyond what the cost
    /// model counts before the stage's gradients: a replay in the stage runs at an unpack, at a
    /// node's start, so on at most this much of the stage's backward. Absent: the stage's
    /// `bwd_transient_bytes` and `grad_bytes` (a replay charged on the stage's whole peak).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bwd_replay_bytes: Option<i64>,
    /// What the profile's steady all-recompute step measured above the model's prediction of it
    /// while a segment replayed in this unit's backward stage (tensors the replay's module calls
    /// keep that the first step's per-unit replays let go of, such as Python numbers autograd saves
    /// without hooks): added under every replay of the stage. Absent: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replay_slack_bytes: Option<i64>,
}

/// The executor's own host seconds per action on the profiled device (cuda_exec/calibrate.py):
/// what a plan's step costs beyond the plain step's stages and its replays' forwards.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ExecutorCosts {
    /// Per replayed checkpoint segment.
    #[serde(default)]
    pub segment: f64,
    /// Per saved tensor a recomputed unit's segment makes (dropped, regenerated, unpacked).
    #[serde(default)]
    pub drop: f64,
    /// Per swapped storage (its copy out and back, its unpack).
    #[serde(default)]
    pub swap: f64,
    /// Per swapped storage larger than `inline_bytes` (the CPU backend copies those on its copy
    /// thread, smaller ones on the caller's). Absent: `swap`.
    #[serde(default)]
    pub swap_async: Option<f64>,
    #[serde(default)]
    pub inline_bytes: f64,
    /// Per glue call of a tracked segment (recorded in the forward, replayed from the recording).
    #[serde(default)]
    pub tracked_op: f64,
    /// Per unit after a plan's first swapped unit: the swap work at its stage boundaries (frees
    /// of completed copies, deadlines, the prefetch schedule's hooks). Absent: 0 (older profiles
    /// have it spread over `swap`).
    #[serde(default)]
    pub stage: f64,
    /// Per step under any plan, all-retain too: the executor's work that no action causes
    /// (checking the inputs and which parameters require grad, the step's state, the backward's
    /// hook), charged in the first forward stage. Absent: 0 (older profiles have it spread over
    /// `drop` and `stage`).
    #[serde(default)]
    pub step: f64,
}

impl ExecutorCosts {
    /// Host seconds to swap `bytes` of activations held in `storages` storages: `swap` per storage,
    /// `swap_async` where their mean size is above `inline_bytes`. Storages of at most
    /// `inline_bytes` are copied on the caller's thread (the CPU backend's small copies), so their
    /// copies out and back, at the links' bandwidths `d2h` and `h2d`, are host time too.
    pub fn swap_host(&self, bytes: f64, storages: f64, d2h: f64, h2d: f64) -> f64 {
        let per = bytes / storages.max(1.0);
        if per > self.inline_bytes {
            self.swap_async.unwrap_or(self.swap) * storages
        } else {
            self.swap * storages + bytes / d2h + bytes / h2d
        }
    }
}

/// The optimizer step after the backward (docs/cost-model.md, "Optimizer step"): present when
/// the profile was measured with an optimizer. The per-unit parts are on the units; this holds
/// the part over parameters of no unit (used in glue code).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OptimizerStep {
    /// The optimizer's class (descriptive).
    #[serde(default)]
    pub name: String,
    /// Seconds of the step over parameters that no unit owns.
    #[serde(default)]
    pub other_time: f64,
    /// Memory that part allocates while it runs.
    #[serde(default)]
    pub other_transient_bytes: i64,
    /// Seconds of one whole optimizer step (one call over every parameter: what runs when no
    /// parameters or optimizer state are swapped across iterations).
    #[serde(default)]
    pub step_time: f64,
    /// Memory one whole step allocates while it runs.
    #[serde(default)]
    pub transient_bytes: i64,
}

fn default_kind() -> String {
    "other".to_string()
}
fn default_true() -> bool {
    true
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Profile {
    pub format: String,
    pub version: u32,
    #[serde(default)]
    pub model: String,
    #[serde(default)]
    pub device: String,
    #[serde(default)]
    pub batch_size: Option<u64>,
    #[serde(default)]
    pub memory: ConstantMemory,
    pub d2h_bandwidth: f64,
    pub h2d_bandwidth: f64,
    #[serde(default)]
    pub measured: Measured,
    /// Copy engines that can run at once: 2 when device-to-host and host-to-device copies overlap
    /// (one queue per direction), 1 otherwise (one FIFO queue). Absent: 1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub copy_engines: Option<u32>,
    /// What the profile was measured under (library versions, threads, kernels, allocator
    /// settings): descriptive, compared by `run()`, not part of the fingerprint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<serde_json::Value>,
    /// The optimizer step (absent: the step ends with the backward, as before it was modelled).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimizer: Option<OptimizerStep>,
    /// Device bytes of the random-number generators' state a checkpoint segment whose forward
    /// draws random numbers keeps from its start to its replay (the CPU generator's state on a
    /// CPU, where it is device memory; 0 on a GPU). Absent: 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rng_state_bytes: Option<u64>,
    /// The executor's host costs on the profiled device (absent: none charged).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub executor: Option<ExecutorCosts>,
    pub units: Vec<Unit>,
}

/// A validated profile with the indexes the evaluator walks. All sizes are unsigned here.
#[derive(Debug, Clone)]
pub struct Graph {
    pub n: usize,
    pub constant: u64,
    pub d2h: f64,
    pub h2d: f64,
    pub fwd_time: Vec<f64>,
    pub bwd_time: Vec<f64>,
    pub act: Vec<u64>,
    pub out: Vec<u64>,
    pub out_saved: Vec<bool>,
    pub held: Vec<u64>,
    /// Per unit, whether its segment draws random numbers (a checkpoint segment containing it
    /// holds `rng_state` bytes from its start to its replay).
    pub random: Vec<bool>,
    pub rng_state: u64,
    /// Per unit, the profile says the executor cannot replay it (`recomputable: false`); whether
    /// any unit is so.
    pub no_recompute: Vec<bool>,
    pub any_no_recompute: bool,
    /// Per unit: saved tensors its segment makes, storages of its activations, glue calls of its
    /// segment (as f64: the host costs multiply them), the units of the module call holding its
    /// glue (`Some((usize::MAX, usize::MAX))`: none; None: no glue).
    pub packs: Vec<f64>,
    pub act_storages: Vec<f64>,
    pub glue_ops: Vec<f64>,
    pub glue_scope: Vec<Option<(usize, usize)>>,
    /// Host seconds to issue each stage (GPU profiles), None on a CPU.
    pub fwd_host: Option<Vec<f64>>,
    pub bwd_host: Option<Vec<f64>>,
    pub costs: ExecutorCosts,
    /// Per unit, `held_from` as (producer, bytes) pairs (empty when the profile has none).
    pub held_from: Vec<Vec<(usize, u64)>>,
    /// Per unit, `saved_from` as (producer, bytes) pairs (empty when the profile has none).
    pub saved_from: Vec<Vec<(usize, u64)>>,
    /// Per unit, `held_values` / `saved_values` as (producer, value id, bytes), and one more than
    /// the largest id; all empty and 0 unless every unit has both.
    pub held_values: Vec<Vec<(usize, usize, u64)>>,
    pub saved_values: Vec<Vec<(usize, usize, u64)>>,
    pub value_ids: usize,
    /// Default checkpoint segment boundaries: `block_start[u]` when unit u starts a repeated
    /// block (recipes::repeated_blocks); a run of recomputed units is split there.
    pub block_start: Vec<bool>,
    /// 1: one FIFO copy queue; 2: one queue per direction.
    pub copy_engines: usize,
    pub fwd_transient: Vec<u64>,
    pub bwd_transient: Vec<u64>,
    /// Per unit, `loss_transient_bytes` (0 when absent).
    pub loss_transient: Vec<u64>,
    /// Per unit, what the backward of its stage has allocated when a replay in the stage runs:
    /// `bwd_replay_bytes` (at most the stage's transient and gradients; those when absent), plus
    /// `replay_slack_bytes`.
    pub bwd_replay: Vec<u64>,
    pub grad: Vec<u64>,
    pub inputs: Vec<Vec<usize>>,
    /// Per unit, the inputs whose activations a replay of the unit needs resident (`saved_inputs`,
    /// or the inputs whose output is saved when a profile does not list them), ascending.
    pub replay_inputs: Vec<Vec<usize>>,
    /// Per unit, bytes a replay allocates on top of its activations while it runs.
    pub replay_extra: Vec<u64>,
    /// Per unit, the profile's `fwd_large_allocs`, `bwd_large_allocs`, `replay_large_allocs`
    /// (empty when absent).
    pub fwd_large: Vec<Vec<u64>>,
    pub bwd_large: Vec<Vec<u64>>,
    pub replay_large: Vec<Vec<u64>>,
    /// Per unit, bytes of its activations still referenced by the forward after its last forward
    /// reader (0 if none), and the forward stage after which they are let go (`n`: never in
    /// the forward).
    pub linger: Vec<u64>,
    pub linger_until: Vec<usize>,
    /// For each forward stage, the units whose lingering bytes the forward lets go of after it.
    pub linger_release_after_fwd: Vec<Vec<usize>>,
    /// Per unit, `lingering_values` as (value id, bytes) (empty without value ids), and whether
    /// any unit has some.
    pub linger_values: Vec<Vec<(usize, u64)>>,
    pub any_linger_values: bool,
    /// Last forward stage that reads the unit's output (the unit itself if nobody does).
    pub last_fwd: Vec<usize>,
    /// Per unit, the last forward stage after which the forward may still reference its
    /// activations: `forward_held_until`, from its first forward reader (after which a swapped
    /// unit's copy is queued) to `last_fwd` (`last_fwd` when absent). A swapped unit's bytes stay
    /// until it has run, whenever the copy completes; a recomputed unit's leave after it.
    pub busy_until: Vec<usize>,
    /// For each forward stage, the units whose `busy_until` it is.
    pub busy_release_after_fwd: Vec<Vec<usize>>,
    /// Backward stage that first needs the unit's activations (largest reader), or None.
    pub first_need: Vec<Option<usize>>,
    /// Backward stage after which the activations are freed (smallest reader), or None.
    pub last_use: Vec<Option<usize>>,
    /// For each backward stage, the units whose activations it reads, largest first.
    pub needs: Vec<Vec<usize>>,
    /// For each unit, the backward stages that read its activations (`needs` inverted), smallest
    /// first.
    pub readers: Vec<Vec<usize>>,
    /// For each backward stage, the units whose activations are freed after it.
    pub frees_after_bwd: Vec<Vec<usize>>,
    /// For each forward stage, the units whose last forward reader it is (including itself).
    pub releases_after_fwd: Vec<Vec<usize>>,
    /// For each forward stage, the units whose first forward reader it is (the unit itself if
    /// nobody reads its output): a swapped unit's copy is queued after it, where the executor
    /// queues a storage that a reader saves (the end of the stage that saved it).
    pub swap_outs_after_fwd: Vec<Vec<usize>>,
    /// Units with readers, in the order the backward pass first needs them.
    pub need_order: Vec<usize>,
    /// The profile has an optimizer step: the step ends with the optimizer stages.
    pub has_optimizer: bool,
    /// Per unit, bytes of the parameters it brings in first (`param_bytes`), their optimizer
    /// state (`optimizer_state_bytes`), the time and transient of its part of the optimizer step.
    pub param: Vec<u64>,
    pub opt_state: Vec<u64>,
    pub opt_time: Vec<f64>,
    pub opt_transient: Vec<u64>,
    /// The optimizer stages in the order they run: units with optimizer work, last unit first,
    /// then `n` (the parameters of no unit). Empty without an optimizer step.
    pub opt_order: Vec<usize>,
    /// Time and transient of stage `opt:n` (the parameters of no unit).
    pub opt_other_time: f64,
    pub opt_other_transient: u64,
    /// Time and transient of the whole optimizer step in one call (stage `opt`).
    pub opt_step_time: f64,
    pub opt_step_transient: u64,
}

impl Graph {
    /// `actions` as the executor runs them: a unit it cannot replay is retained where they say
    /// recompute (None: no unit is changed).
    pub fn recomputable_plan(&self, actions: &[Action]) -> Option<Vec<Action>> {
        if !self.any_no_recompute || !actions.iter().zip(&self.no_recompute).any(|(&a, &no)| no && a == Action::Recompute) {
            return None;
        }
        Some(actions.iter().zip(&self.no_recompute).map(|(&a, &no)| if no && a == Action::Recompute { Action::Retain } else { a }).collect())
    }

    /// Position of a stage in the step (and in an outcome's curve): forward stage i is i,
    /// backward stage i is 2n-1-i, the whole optimizer step or the k-th optimizer stage 2n+k.
    pub fn stage_index(&self, stage: crate::evaluator::Stage) -> usize {
        use crate::evaluator::Stage;
        match stage {
            Stage::Start => 0,
            Stage::Fwd(i) => i,
            Stage::Bwd(i) => 2 * self.n - 1 - i,
            Stage::Opt(u) => 2 * self.n + self.opt_order.iter().position(|&v| v == u).unwrap_or(0),
            Stage::OptStep => 2 * self.n,
        }
    }

    /// Time and transient of optimizer stage `u` (a unit, or n for the parameters of no unit).
    pub fn opt_stage(&self, u: usize) -> (f64, u64) {
        if u < self.n {
            (self.opt_time[u], self.opt_transient[u])
        } else {
            (self.opt_other_time, self.opt_other_transient)
        }
    }
}

impl Profile {
    pub fn from_json(text: &str) -> Result<Profile> {
        let profile: Profile = read_versioned(text, "profile", PROFILE_FORMAT, PROFILE_VERSION, "re-profile the model")?;
        profile.graph()?;
        Ok(profile)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("profile serialises")
    }

    /// The allocator settings the profile was measured under: `environment.variables`'
    /// `PYTORCH_ALLOC_CONF` (torch's newer name, read first), else `PYTORCH_CUDA_ALLOC_CONF`;
    /// "" (the defaults) when neither was recorded.
    pub fn alloc_conf(&self) -> String {
        let vars = self.environment.as_ref().and_then(|e| e.get("variables"));
        for key in ["PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"] {
            if let Some(v) = vars.and_then(|v| v.get(key)).and_then(|v| v.as_str()) {
                return v.to_string();
            }
        }
        String::new()
    }

    /// SHA-256 over the structure (names, kinds, edges, sizes), not over times or bandwidths.
    pub fn fingerprint(&self) -> String {
        let mut h = Sha256::new();
        h.update(format!("{}|{}|", self.units.len(), self.memory.total()));
        for u in &self.units {
            h.update(format!(
                "{}|{}|{:?}|{:?}|{}|{}|{}|{:?}|{}|{}|{}|{};",
                u.name,
                u.kind,
                u.inputs,
                u.model_inputs,
                u.act_bytes,
                u.output_bytes,
                u.output_saved,
                u.read_by,
                u.held_input_bytes,
                u.fwd_transient_bytes,
                u.bwd_transient_bytes,
                u.grad_bytes
            ));
            if let Some(s) = &u.saved_inputs {
                h.update(format!("saved_inputs{s:?};"));
            }
            if let Some(b) = u.replay_transient_bytes {
                h.update(format!("replay_transient{b};"));
            }
            if let (Some(b), Some(t)) = (u.lingering_bytes, u.lingering_until) {
                h.update(format!("lingering{b}@{t};"));
            }
            if let Some(lv) = &u.lingering_values {
                h.update(format!("lingering_values{lv:?};"));
            }
            if let Some(t) = u.forward_held_until {
                h.update(format!("forward_held_until{t};"));
            }
            if let Some(hf) = &u.held_from {
                h.update(format!("held_from{hf:?};"));
            }
            if let Some(sf) = &u.saved_from {
                h.update(format!("saved_from{sf:?};"));
            }
            if let Some(b) = u.param_bytes {
                h.update(format!("param{b};"));
            }
            if let Some(b) = u.optimizer_state_bytes {
                h.update(format!("optimizer_state{b};"));
            }
            if let Some(b) = u.optimizer_transient_bytes {
                h.update(format!("optimizer_transient{b};"));
            }
        }
        if let Some(o) = &self.optimizer {
            h.update(format!("optimizer{}|{}|{};", o.name, o.other_transient_bytes, o.transient_bytes));
        }
        h.finalize().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// Validate and build the evaluator's indexes.
    pub fn graph(&self) -> Result<Graph> {
        let n = self.units.len();
        if n == 0 {
            return Err(CoreError::InvalidProfile("the profile has no units".into()));
        }
        for (what, bw) in [("d2h_bandwidth", self.d2h_bandwidth), ("h2d_bandwidth", self.h2d_bandwidth)] {
            if !(bw.is_finite() && bw > 0.0) {
                return Err(CoreError::InvalidProfile(format!(
                    "{what} is {bw}; it must be a positive number of bytes per second"
                )));
            }
        }
        if let Some(c) = &self.executor {
            for (what, v) in [
                ("segment", c.segment),
                ("drop", c.drop),
                ("swap", c.swap),
                ("swap_async", c.swap_async.unwrap_or(0.0)),
                ("tracked_op", c.tracked_op),
                ("inline_bytes", c.inline_bytes),
            ] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(CoreError::InvalidProfile(format!(
                        "executor.{what} is {v}; the executor's host costs are non-negative seconds"
                    )));
                }
            }
        }
        let copy_engines = self.copy_engines.unwrap_or(1);
        if !(1..=2).contains(&copy_engines) {
            return Err(CoreError::InvalidProfile(format!(
                "copy_engines is {copy_engines}; it must be 1 (one copy queue) or 2 (one per direction)"
            )));
        }
        // Unknown inputs and cycles first, then order.
        for (i, u) in self.units.iter().enumerate() {
            for &p in &u.inputs {
                if p < 0 || p as usize >= n {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {i} ({}) reads unknown unit {p}; inputs must be indices 0..{}",
                        u.name,
                        n - 1
                    )));
                }
            }
            for &p in u.saved_inputs.iter().flatten() {
                if !u.inputs.contains(&p) {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {i} ({}) lists {p} in saved_inputs but not in inputs; saved_inputs must be a subset of inputs",
                        u.name
                    )));
                }
            }
            for &r in &u.read_by {
                if r < 0 || r as usize >= n {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {i} ({}) lists unknown unit {r} in read_by; indices must be 0..{}",
                        u.name,
                        n - 1
                    )));
                }
            }
            for &m in &u.model_inputs {
                if m < 0 {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {i} ({}) reads model input {m}; model input indices are non-negative",
                        u.name
                    )));
                }
            }
            let sizes = [
                ("act_bytes", u.act_bytes),
                ("output_bytes", u.output_bytes),
                ("held_input_bytes", u.held_input_bytes),
                ("fwd_transient_bytes", u.fwd_transient_bytes),
                ("bwd_transient_bytes", u.bwd_transient_bytes),
                ("grad_bytes", u.grad_bytes),
                ("replay_transient_bytes", u.replay_transient_bytes.unwrap_or(0)),
                ("loss_transient_bytes", u.loss_transient_bytes.unwrap_or(0)),
                ("bwd_replay_bytes", u.bwd_replay_bytes.unwrap_or(0)),
                ("replay_slack_bytes", u.replay_slack_bytes.unwrap_or(0)),
                ("lingering_bytes", u.lingering_bytes.unwrap_or(0)),
                ("param_bytes", u.param_bytes.unwrap_or(0)),
                ("optimizer_state_bytes", u.optimizer_state_bytes.unwrap_or(0)),
                ("optimizer_transient_bytes", u.optimizer_transient_bytes.unwrap_or(0)),
            ];
            for (what, v) in sizes {
                if v < 0 {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {i} ({}) has negative {what} ({v}); sizes are bytes >= 0",
                        u.name
                    )));
                }
            }
            for (what, v) in [
                ("fwd_time", u.fwd_time),
                ("bwd_time", u.bwd_time),
                ("optimizer_time", u.optimizer_time.unwrap_or(0.0)),
                ("fwd_host_time", u.fwd_host_time.unwrap_or(0.0)),
                ("bwd_host_time", u.bwd_host_time.unwrap_or(0.0)),
            ] {
                if !(v.is_finite() && v >= 0.0) {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {i} ({}) has {what} = {v}; times are seconds >= 0",
                        u.name
                    )));
                }
            }
            if u.lingering_bytes.unwrap_or(0) > u.act_bytes {
                return Err(CoreError::InvalidProfile(format!(
                    "unit {i} ({}) has lingering_bytes ({}) above its act_bytes ({}); they are part of its activations",
                    u.name,
                    u.lingering_bytes.unwrap_or(0),
                    u.act_bytes
                )));
            }
            if let Some(t) = u.forward_held_until {
                if t < i as i64 || t > n as i64 {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {i} ({}) has forward_held_until {t}; it must be a forward stage from {i} to {n} ({n}: after the forward)",
                        u.name
                    )));
                }
            }
            if u.lingering_bytes.unwrap_or(0) > 0 {
                match u.lingering_until {
                    Some(t) if t >= i as i64 && t <= n as i64 => {}
                    other => {
                        return Err(CoreError::InvalidProfile(format!(
                            "unit {i} ({}) has lingering_bytes but lingering_until is {other:?}; it must be a forward stage from {i} to {n} ({n}: after the forward)",
                            u.name
                        )));
                    }
                }
            }
            for &[p, b] in u.saved_from.iter().flatten() {
                if p < 0 || p >= i as i64 || b < 0 {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {i} ({}) has saved_from entry [{p}, {b}]; it must be [an earlier unit 0..{i}, bytes >= 0]",
                        u.name
                    )));
                }
            }
            for &[v, b] in u.lingering_values.iter().flatten() {
                if v < 0 || b < 0 || b > u.lingering_bytes.unwrap_or(0) {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {i} ({}) has lingering_values entry [{v}, {b}]; it must be [value id >= 0, bytes from 0 to its lingering_bytes]",
                        u.name
                    )));
                }
            }
            for (what, vals) in [("held_values", &u.held_values), ("saved_values", &u.saved_values)] {
                for &[p, v, b] in vals.iter().flatten() {
                    if p < 0 || p >= i as i64 || v < 0 || b < 0 {
                        return Err(CoreError::InvalidProfile(format!(
                            "unit {i} ({}) has {what} entry [{p}, {v}, {b}]; it must be [an earlier unit 0..{i}, value id >= 0, bytes >= 0]",
                            u.name
                        )));
                    }
                }
            }
            if let Some(hf) = &u.held_from {
                let mut total = 0i64;
                for &[p, b] in hf {
                    if p < 0 || p >= i as i64 || b < 0 {
                        return Err(CoreError::InvalidProfile(format!(
                            "unit {i} ({}) has held_from entry [{p}, {b}]; it must be [an earlier unit 0..{i}, bytes >= 0]",
                            u.name
                        )));
                    }
                    total += b;
                }
                if total > u.held_input_bytes {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {i} ({}) has held_from summing to {total} bytes, above its held_input_bytes ({}); it is a part of them",
                        u.name, u.held_input_bytes
                    )));
                }
            }
            if u.act_bytes > 0 && u.read_by.is_empty() {
                return Err(CoreError::InvalidProfile(format!(
                    "unit {i} ({}) owns {} activation bytes but read_by is empty; list the units whose backward reads them",
                    u.name, u.act_bytes
                )));
            }
        }
        self.check_optimizer_fields()?;
        if let Some(cycle) = find_cycle(&self.units) {
            let names: Vec<String> = cycle.iter().map(|&i| format!("{i} ({})", self.units[i].name)).collect();
            return Err(CoreError::InvalidProfile(format!(
                "the unit graph has a cycle: {}; a profile must be a DAG",
                names.join(" -> ")
            )));
        }
        for (i, u) in self.units.iter().enumerate() {
            for &p in &u.inputs {
                if p as usize >= i {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {i} ({}) reads unit {p} ({}), which runs later; units must be listed in forward execution order",
                        u.name, self.units[p as usize].name
                    )));
                }
            }
            for &r in &u.read_by {
                if (r as usize) < i {
                    return Err(CoreError::InvalidProfile(format!(
                        "unit {r} ({}) reads the activations of unit {i} ({}) in backward but runs before it in forward",
                        self.units[r as usize].name, u.name
                    )));
                }
            }
        }

        let g_inputs: Vec<Vec<usize>> = self
            .units
            .iter()
            .map(|u| {
                let mut v: Vec<usize> = u.inputs.iter().map(|&p| p as usize).collect();
                v.sort_unstable();
                v.dedup();
                v
            })
            .collect();
        let replay_inputs: Vec<Vec<usize>> = self
            .units
            .iter()
            .zip(&g_inputs)
            .map(|(u, ins)| match &u.saved_inputs {
                Some(s) => {
                    let mut v: Vec<usize> = s.iter().map(|&p| p as usize).collect();
                    v.sort_unstable();
                    v.dedup();
                    v
                }
                None => ins.iter().copied().filter(|&p| self.units[p].output_saved).collect(),
            })
            .collect();
        let mut last_fwd: Vec<usize> = (0..n).collect();
        let mut first_fwd: Vec<Option<usize>> = vec![None; n];
        for (i, ins) in g_inputs.iter().enumerate() {
            for &p in ins {
                last_fwd[p] = last_fwd[p].max(i);
                if p < i {
                    first_fwd[p] = Some(first_fwd[p].map_or(i, |f| f.min(i)));
                }
            }
        }
        let mut swap_outs_after_fwd = vec![Vec::new(); n];
        for (u, f) in first_fwd.iter().enumerate() {
            swap_outs_after_fwd[f.unwrap_or(u)].push(u);
        }
        let mut first_need = vec![None; n];
        let mut last_use = vec![None; n];
        let mut needs = vec![Vec::new(); n];
        let mut readers_of = vec![Vec::new(); n];
        let mut frees_after_bwd = vec![Vec::new(); n];
        let mut releases_after_fwd = vec![Vec::new(); n];
        for (u, unit) in self.units.iter().enumerate() {
            let mut readers: Vec<usize> = unit.read_by.iter().map(|&r| r as usize).collect();
            readers.sort_unstable();
            readers.dedup();
            if let (Some(&lo), Some(&hi)) = (readers.first(), readers.last()) {
                first_need[u] = Some(hi);
                last_use[u] = Some(lo);
                frees_after_bwd[lo].push(u);
                for &r in &readers {
                    needs[r].push(u);
                }
            }
            readers_of[u] = readers;
            releases_after_fwd[last_fwd[u]].push(u);
        }
        for v in needs.iter_mut() {
            v.sort_unstable_by(|a, b| b.cmp(a));
        }
        let busy_until: Vec<usize> = self
            .units
            .iter()
            .enumerate()
            .map(|(u, unit)| {
                // no earlier than its first forward reader, after which its copy is queued
                let first = first_fwd[u].unwrap_or(u);
                unit.forward_held_until.map_or(last_fwd[u], |t| (t.max(0) as usize).clamp(first, last_fwd[u]))
            })
            .collect();
        let mut busy_release_after_fwd = vec![Vec::new(); n];
        for (u, &b) in busy_until.iter().enumerate() {
            busy_release_after_fwd[b].push(u);
        }
        let mut linger = vec![0u64; n];
        let mut linger_until = last_fwd.clone();
        let mut linger_release_after_fwd = vec![Vec::new(); n];
        for (u, unit) in self.units.iter().enumerate() {
            let bytes = unit.lingering_bytes.unwrap_or(0) as u64;
            let until = unit.lingering_until.unwrap_or(0).max(0) as usize;
            if bytes > 0 && until > last_fwd[u] {
                linger[u] = bytes;
                linger_until[u] = until;
                if until < n {
                    linger_release_after_fwd[until].push(u);
                }
            }
        }
        let replay_extra: Vec<u64> = self
            .units
            .iter()
            .map(|u| match u.replay_transient_bytes {
                Some(b) => b as u64,
                None => (if u.output_saved { 0 } else { u.output_bytes } + u.fwd_transient_bytes) as u64,
            })
            .collect();
        let mut need_order: Vec<usize> = (0..n).filter(|&u| first_need[u].is_some()).collect();
        need_order.sort_unstable_by(|&a, &b| first_need[b].cmp(&first_need[a]).then(b.cmp(&a)));
        let u64s = |f: &dyn Fn(&Unit) -> i64| -> Vec<u64> { self.units.iter().map(|u| f(u) as u64).collect() };
        // Value ids only when every unit has them (a segment's readers are compared by id).
        let keyed = self.units.iter().all(|u| u.held_values.is_some() && u.saved_values.is_some());
        let value_ids = if keyed {
            self.units
                .iter()
                .flat_map(|u| u.held_values.iter().chain(u.saved_values.iter()).flatten())
                .map(|&[_, v, _]| v as usize + 1)
                .max()
                .unwrap_or(0)
        } else {
            0
        };
        let values = |f: &dyn Fn(&Unit) -> &Option<Vec<[i64; 3]>>| -> Vec<Vec<(usize, usize, u64)>> {
            self.units
                .iter()
                .map(|u| match (keyed, f(u)) {
                    (true, Some(vals)) => vals.iter().map(|&[p, v, b]| (p as usize, v as usize, b as u64)).collect(),
                    _ => Vec::new(),
                })
                .collect()
        };
        let linger_values: Vec<Vec<(usize, u64)>> = (0..n)
            .map(|u| match &self.units[u].lingering_values {
                Some(lv) if linger[u] > 0 => lv
                    .iter()
                    .filter(|&&[v, _]| (v as usize) < value_ids)
                    .map(|&[v, b]| (v as usize, b as u64))
                    .collect(),
                _ => Vec::new(),
            })
            .collect();
        let any_linger_values = linger_values.iter().any(|lv| !lv.is_empty());
        let has_optimizer = self.optimizer.is_some();
        let opt_of = |f: &dyn Fn(&Unit) -> i64| -> Vec<u64> {
            if has_optimizer { u64s(f) } else { vec![0; n] }
        };
        let param = opt_of(&|u| u.param_bytes.unwrap_or(0));
        let opt_state = opt_of(&|u| u.optimizer_state_bytes.unwrap_or(0));
        let opt_transient = opt_of(&|u| u.optimizer_transient_bytes.unwrap_or(0));
        let opt_time: Vec<f64> =
            self.units.iter().map(|u| if has_optimizer { u.optimizer_time.unwrap_or(0.0) } else { 0.0 }).collect();
        let opt_order: Vec<usize> = if has_optimizer {
            (0..n)
                .rev()
                .filter(|&u| param[u] + opt_state[u] + opt_transient[u] > 0 || opt_time[u] > 0.0)
                .chain(std::iter::once(n))
                .collect()
        } else {
            Vec::new()
        };
        let other = self.optimizer.clone().unwrap_or_default();
        Ok(Graph {
            n,
            constant: self.memory.total(),
            d2h: self.d2h_bandwidth,
            h2d: self.h2d_bandwidth,
            fwd_time: self.units.iter().map(|u| u.fwd_time).collect(),
            bwd_time: self.units.iter().map(|u| u.bwd_time).collect(),
            act: u64s(&|u| u.act_bytes),
            out: u64s(&|u| u.output_bytes),
            out_saved: self.units.iter().map(|u| u.output_saved).collect(),
            held: u64s(&|u| u.held_input_bytes),
            random: self.units.iter().map(|u| u.random).collect(),
            no_recompute: self.units.iter().map(|u| u.recomputable == Some(false)).collect(),
            any_no_recompute: self.units.iter().any(|u| u.recomputable == Some(false)),
            rng_state: self.rng_state_bytes.unwrap_or(0),
            packs: self.units.iter().map(|u| u.packs.unwrap_or(0) as f64).collect(),
            act_storages: self
                .units
                .iter()
                .map(|u| u.act_storages.map(f64::from).unwrap_or(if u.act_bytes > 0 { 1.0 } else { 0.0 }))
                .collect(),
            glue_ops: self.units.iter().map(|u| u.glue_ops.unwrap_or(0) as f64).collect(),
            glue_scope: self
                .units
                .iter()
                .map(|u| match u.glue_scope {
                    None => None,
                    Some([f, l]) if f >= 0 && l >= f => Some((f as usize, l as usize)),
                    Some(_) => Some((usize::MAX, usize::MAX)),
                })
                .collect(),
            fwd_host: if self.units.iter().all(|u| u.fwd_host_time.is_some()) {
                Some(self.units.iter().map(|u| u.fwd_host_time.unwrap_or(0.0)).collect())
            } else {
                None
            },
            bwd_host: if self.units.iter().all(|u| u.bwd_host_time.is_some()) {
                Some(self.units.iter().map(|u| u.bwd_host_time.unwrap_or(0.0)).collect())
            } else {
                None
            },
            costs: self.executor.unwrap_or_default(),
            held_from: self
                .units
                .iter()
                .enumerate()
                .map(|(i, u)| match &u.held_from {
                    Some(hf) => hf.iter().map(|&[p, b]| (p as usize, b as u64)).collect(),
                    None => self.derived_held_from(i, &g_inputs[i], &replay_inputs[i]),
                })
                .collect(),
            saved_from: self
                .units
                .iter()
                .enumerate()
                .map(|(i, u)| match &u.saved_from {
                    Some(sf) => sf.iter().map(|&[p, b]| (p as usize, b as u64)).collect(),
                    None => replay_inputs[i].iter().map(|&p| (p, self.saved_value_bytes(p))).collect(),
                })
                .collect(),
            held_values: values(&|u| &u.held_values),
            saved_values: values(&|u| &u.saved_values),
            value_ids,
            block_start: {
                let mut starts = vec![false; n];
                for (a, _) in crate::recipes::repeated_blocks(self) {
                    starts[a] = true;
                }
                starts
            },
            copy_engines: copy_engines as usize,
            fwd_transient: u64s(&|u| u.fwd_transient_bytes),
            bwd_transient: u64s(&|u| u.bwd_transient_bytes),
            loss_transient: u64s(&|u| u.loss_transient_bytes.unwrap_or(0)),
            bwd_replay: u64s(&|u| {
                let whole = u.bwd_transient_bytes + u.grad_bytes;
                u.bwd_replay_bytes.map_or(whole, |b| b.min(whole)) + u.replay_slack_bytes.unwrap_or(0)
            }),
            grad: u64s(&|u| u.grad_bytes),
            inputs: g_inputs,
            replay_inputs,
            replay_extra,
            fwd_large: self.units.iter().map(|u| u.fwd_large_allocs.clone().unwrap_or_default()).collect(),
            bwd_large: self.units.iter().map(|u| u.bwd_large_allocs.clone().unwrap_or_default()).collect(),
            replay_large: self.units.iter().map(|u| u.replay_large_allocs.clone().unwrap_or_default()).collect(),
            linger,
            linger_until,
            linger_release_after_fwd,
            linger_values,
            any_linger_values,
            last_fwd,
            busy_until,
            busy_release_after_fwd,
            first_need,
            last_use,
            needs,
            readers: readers_of,
            frees_after_bwd,
            releases_after_fwd,
            swap_outs_after_fwd,
            need_order,
            has_optimizer,
            param,
            opt_state,
            opt_time,
            opt_transient,
            opt_order,
            opt_other_time: other.other_time,
            opt_other_transient: other.other_transient_bytes.max(0) as u64,
            opt_step_time: other.step_time,
            opt_step_transient: other.transient_bytes.max(0) as u64,
        })
    }
}

impl Profile {
    /// The optimizer fields add up: the units' parameters and optimizer state are parts of the
    /// constant memory's, and the optimizer step's own numbers are valid.
    fn check_optimizer_fields(&self) -> Result<()> {
        let params: i64 = self.units.iter().map(|u| u.param_bytes.unwrap_or(0)).sum();
        let states: i64 = self.units.iter().map(|u| u.optimizer_state_bytes.unwrap_or(0)).sum();
        if params as u64 > self.memory.parameters {
            return Err(CoreError::InvalidProfile(format!(
                "the units' param_bytes sum to {params} bytes, above memory.parameters ({}); they are a part of it",
                self.memory.parameters
            )));
        }
        if states as u64 > self.memory.optimizer_state {
            return Err(CoreError::InvalidProfile(format!(
                "the units' optimizer_state_bytes sum to {states} bytes, above memory.optimizer_state ({}); they are a part of it",
                self.memory.optimizer_state
            )));
        }
        if let Some(o) = &self.optimizer {
            let times = [o.other_time, o.step_time];
            if !times.iter().all(|t| t.is_finite() && *t >= 0.0) || o.other_transient_bytes < 0 || o.transient_bytes < 0 {
                return Err(CoreError::InvalidProfile(format!(
                    "optimizer has other_time {}, other_transient_bytes {}, step_time {}, transient_bytes {}; they must be >= 0",
                    o.other_time, o.other_transient_bytes, o.step_time, o.transient_bytes
                )));
            }
        }
        Ok(())
    }

    /// `held_from` of a profile without it: the unit's held bytes, attributed to its inputs whose
    /// output is not saved (and that it does not read saved values of), up to their output size.
    fn derived_held_from(&self, i: usize, inputs: &[usize], saved: &[usize]) -> Vec<(usize, u64)> {
        let mut left = self.units[i].held_input_bytes.max(0) as u64;
        let mut out = Vec::new();
        for &p in inputs {
            let q = &self.units[p];
            if q.output_saved || saved.contains(&p) || left == 0 {
                continue;
            }
            let b = (q.output_bytes.max(0) as u64).min(left);
            left -= b;
            out.push((p, b));
        }
        out
    }

    /// Bytes of the saved value a reader takes from unit `p` in a profile without `saved_from`:
    /// its output when saved, else (a saved glue value) its activations.
    fn saved_value_bytes(&self, p: usize) -> u64 {
        let q = &self.units[p];
        let b = if q.output_saved { q.output_bytes.min(q.act_bytes) } else { q.act_bytes };
        b.max(0) as u64
    }
}

/// A cycle in the input graph, if any, as a list of unit indices.
fn find_cycle(units: &[Unit]) -> Option<Vec<usize>> {
    let n = units.len();
    // 0 = unvisited, 1 = on stack, 2 = done
    let mut state = vec![0u8; n];
    let mut parent = vec![usize::MAX; n];
    for start in 0..n {
        if state[start] != 0 {
            continue;
        }
        let mut stack: Vec<(usize, usize)> = vec![(start, 0)];
        state[start] = 1;
        while let Some(&mut (v, ref mut k)) = stack.last_mut() {
            let ins = &units[v].inputs;
            if *k < ins.len() {
                let w = ins[*k] as usize;
                *k += 1;
                if state[w] == 0 {
                    state[w] = 1;
                    parent[w] = v;
                    stack.push((w, 0));
                } else if state[w] == 1 {
                    let mut cycle = vec![w];
                    let mut x = v;
                    while x != w {
                        cycle.push(x);
                        x = parent[x];
                    }
                    cycle.push(w);
                    cycle.reverse();
                    return Some(cycle);
                }
            } else {
                state[v] = 2;
                stack.pop();
            }
        }
    }
    None
}
