//! Editing a captured CUDA graph: a clone without one kernel's launches (`ornith-bench`'s
//! in-graph cost per kernel, [`crate::backend_cuda::CudaBackend::set_ablated_kernel`]). The
//! launches stay as they are: nothing of the measurement is on the launch path or in what the
//! captured graph is keyed by.
use super::CudaContext;
use anyhow::{Context, Result};
use cudarc::driver::sys::{self, CUgraph, CUgraphEdgeData, CUgraphExec, CUgraphNode};
use cudarc::driver::CudaGraph;

/// A graph instantiated from an edited clone of a captured one; owns both handles.
pub struct EditedGraph {
    graph: CUgraph,
    exec: CUgraphExec,
    /// The kernel nodes removed.
    pub removed: usize,
}

// SAFETY: raw driver handles, usable from any thread once the context is bound (every call below
// binds it first); used only through `&mut` of its owner (the step graphs), so never from two
// threads at once.
unsafe impl Send for EditedGraph {}

impl Drop for EditedGraph {
    fn drop(&mut self) {
        // SAFETY: both handles were created by `CudaContext::graph_without` and are destroyed
        // once, here.
        unsafe {
            let _ = sys::cuGraphExecDestroy(self.exec);
            let _ = sys::cuGraphDestroy(self.graph);
        }
    }
}

/// A node's dependencies (`out = false`) or dependent nodes (`out = true`) with their edges.
/// The arrays are passed filled-in (never a count query with null arrays, which the driver may
/// refuse as lossy when an edge is programmatic) and grown until the driver returns fewer entries
/// than they hold.
///
/// # Safety
/// `node` must be a live node of a graph not used by another thread.
unsafe fn edges(node: CUgraphNode, out: bool) -> Result<Vec<(CUgraphNode, CUgraphEdgeData)>> {
    let mut cap = 8usize;
    loop {
        let mut nodes: Vec<CUgraphNode> = vec![std::ptr::null_mut(); cap];
        // SAFETY: a zeroed edge is a valid plain-data value (the driver overwrites it).
        let mut data: Vec<CUgraphEdgeData> = vec![std::mem::zeroed(); cap];
        let mut n = cap;
        let r = if out {
            sys::cuGraphNodeGetDependentNodes_v2(node, nodes.as_mut_ptr(), data.as_mut_ptr(), &mut n)
        } else {
            sys::cuGraphNodeGetDependencies_v2(node, nodes.as_mut_ptr(), data.as_mut_ptr(), &mut n)
        };
        r.result().context("reading a graph node's edges")?;
        if n < cap {
            nodes.truncate(n);
            data.truncate(n);
            return Ok(nodes.into_iter().zip(data).collect());
        }
        cap *= 8;
    }
}

impl CudaContext {
    /// The name of the kernel a graph node launches (None: not a kernel node, or a kernel this
    /// context did not load).
    ///
    /// # Safety
    /// `node` must be a live node of a graph not used by another thread.
    unsafe fn node_kernel(&self, node: CUgraphNode) -> Result<Option<String>> {
        let mut ty = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        sys::cuGraphNodeGetType(node, &mut ty).result()?;
        if ty != sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_KERNEL {
            return Ok(None);
        }
        // SAFETY: plain data (handles and integers), overwritten by the driver.
        let mut p: sys::CUDA_KERNEL_NODE_PARAMS = std::mem::zeroed();
        sys::cuGraphKernelNodeGetParams_v2(node, &mut p).result().context("reading a kernel node")?;
        if let Some(n) = self.kernel_of(p.func) {
            return Ok(Some(n.to_string()));
        }
        if p.func.is_null() {
            return Ok(None);
        }
        let mut name: *const std::ffi::c_char = std::ptr::null();
        sys::cuFuncGetName(&mut name, p.func).result()?;
        Ok((!name.is_null()).then(|| std::ffi::CStr::from_ptr(name).to_string_lossy().into_owned()))
    }

    /// `g` without the launches of `kernel`: clones the captured graph, removes each kernel node
    /// that launches it, links the node's predecessors to its successors (each new edge carries
    /// the removed node's outgoing edge data, so a programmatic edge stays one), instantiates
    /// and uploads it. A kernel the graph does not launch (one that runs outside it, like the
    /// sampler's) leaves the clone whole: `removed` is 0.
    pub(crate) fn graph_without(&self, g: &CudaGraph, kernel: &str) -> Result<EditedGraph> {
        self.ctx.bind_to_thread()?;
        let mut graph: CUgraph = std::ptr::null_mut();
        // SAFETY: `g` is a live captured graph, used by this thread only (its owner holds it
        // through `&mut`); the clone is ours and destroyed by `EditedGraph` (or below on error).
        unsafe { sys::cuGraphClone(&mut graph, g.cu_graph()) }.result().context("cloning the decode graph")?;
        let mut e = EditedGraph { graph, exec: std::ptr::null_mut(), removed: 0 };
        // SAFETY: every node below belongs to the clone `e.graph`, which only this call uses.
        unsafe {
            let mut n = 0usize;
            sys::cuGraphGetNodes(e.graph, std::ptr::null_mut(), &mut n).result()?;
            let mut nodes = vec![std::ptr::null_mut(); n];
            sys::cuGraphGetNodes(e.graph, nodes.as_mut_ptr(), &mut n).result()?;
            nodes.truncate(n);
            for node in nodes {
                if self.node_kernel(node)?.as_deref() != Some(kernel) {
                    continue;
                }
                let (pred, succ) = (edges(node, false)?, edges(node, true)?);
                sys::cuGraphDestroyNode(node).result().context("removing a kernel node")?;
                for (s, data) in &succ {
                    let have: Vec<CUgraphNode> = edges(*s, false)?.into_iter().map(|x| x.0).collect();
                    for (p, _) in pred.iter().filter(|(p, _)| !have.contains(p)) {
                        sys::cuGraphAddDependencies_v2(e.graph, p, s, data, 1).result().context("re-linking")?;
                    }
                }
                e.removed += 1;
            }
        }
        // SAFETY: the edited clone is a valid graph; the exec is destroyed by `EditedGraph`.
        unsafe {
            sys::cuGraphInstantiateWithFlags(&mut e.exec, e.graph, 0)
                .result()
                .context("instantiating the edited graph")?;
            sys::cuGraphUpload(e.exec, self.stream.cu_stream()).result()?;
        }
        Ok(e)
    }

    /// Launches an edited graph on the stream.
    pub(crate) fn launch_graph(&self, e: &EditedGraph) -> Result<()> {
        self.ctx.bind_to_thread()?;
        // SAFETY: a live instantiated graph, launched on this context's stream.
        unsafe { sys::cuGraphLaunch(e.exec, self.stream.cu_stream()) }.result()?;
        Ok(())
    }
}
