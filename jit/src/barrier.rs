//! Work-group barriers as region boundaries (host code).
//!
//! A kernel with barriers runs on one host thread as a state machine, as pocl's
//! work-group functions do: the kernel is cut at each barrier into regions; the
//! work-group function runs every work-item of the group through the current region
//! up to its next barrier (or its end), then all of them through the region after
//! that barrier, and so on. OpenCL requires every work-item of a group to reach the
//! same barriers in the same order (a barrier in a loop is reached in the same
//! iteration by all), so the barrier the work-items stop at says which region runs
//! next for all of them — also for barriers in work-group-uniform loops, whose
//! regions simply repeat.
//!
//! [`split`] cuts the blocks: after it, every barrier call is gone and the block
//! that held it ends in a branch to the block that follows it, the region's entry
//! (each such edge is a [`Cut`]). [`demote`] then moves every value that lives
//! across blocks into a stack slot (LLVM's `reg2mem`), so that turning the cut edges
//! into region exits breaks no SSA value: what crosses a barrier is in memory, and
//! the work-group function gives those slots one copy per work-item.

use inkwell::basic_block::BasicBlock;
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::module::Module;
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::TargetMachine;
use inkwell::values::{FunctionValue, InstructionOpcode};

use crate::builtins::{classify, Call};
use crate::error::{codegen, JitError};
use crate::raw;

/// A cut barrier: `before` ends in a branch to `after`, where the region that
/// follows the barrier starts.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cut<'ctx> {
    pub before: BasicBlock<'ctx>,
    pub after: BasicBlock<'ctx>,
}

/// Cuts `kernel` at every barrier call (see the module docs).
pub(crate) fn split<'ctx>(
    context: &'ctx Context,
    builder: &Builder<'ctx>,
    kernel: FunctionValue<'ctx>,
) -> Result<Vec<Cut<'ctx>>, JitError> {
    let mut cuts = Vec::new();
    let mut work: Vec<BasicBlock> = kernel.get_basic_block_iter().collect();
    while let Some(block) = work.pop() {
        let barrier = block.get_instructions().find(|i| {
            i.get_opcode() == InstructionOpcode::Call
                && raw::callee_name(*i).is_some_and(|n| classify(&n) == Call::Barrier)
        });
        let Some(barrier) = barrier else { continue };
        // Everything before the barrier (phis included) moves to a new block that
        // takes over the block's predecessors; the block keeps what follows.
        // Replacing a block's uses also rewrites the phis of its successors, which
        // must keep naming `block` (it keeps the terminator): the terminator is
        // unlinked meanwhile, so the block has no successors. A branch of the
        // terminator back to `block` itself does move to `before`, which now heads
        // that loop.
        let before = context.prepend_basic_block(block, "barrier.before");
        let terminator = block
            .get_terminator()
            .ok_or_else(|| codegen(format!("a block of `{}` has no terminator", raw::name(kernel))))?;
        terminator.remove_from_basic_block();
        block.replace_all_uses_with(&before);
        builder.position_at_end(block);
        builder.insert_instruction(&terminator, None);
        let moved: Vec<_> = block.get_instructions().take_while(|i| *i != barrier).collect();
        builder.position_at_end(before);
        for inst in moved {
            inst.remove_from_basic_block();
            builder.insert_instruction(&inst, None);
        }
        barrier.erase_from_basic_block();
        builder.build_unconditional_branch(block).map_err(codegen)?;
        cuts.push(Cut { before, after: block });
        work.push(block); // it may hold more barriers
    }
    // A later cut of the same block moves the start of the region after an earlier
    // barrier into a new block: each region starts where its `before` branches now.
    for cut in &mut cuts {
        let target = cut.before.get_terminator().and_then(|t| t.get_operand(0)).and_then(|o| o.block());
        cut.after = target.ok_or_else(|| codegen("a cut block lost its branch"))?;
    }
    Ok(cuts)
}

/// Demotes every SSA value used outside its block, and every phi, to a stack slot in
/// the kernel's entry block (LLVM's `reg2mem`).
pub(crate) fn demote(module: &Module, target: &TargetMachine) -> Result<(), JitError> {
    module
        .run_passes("function(reg2mem)", target, PassBuilderOptions::create())
        .map_err(|e| codegen(format!("reg2mem: {}", raw::text(&e))))
}
