// Definitions of the argument checks declared in csr_linear_checks.h.
#include "csr_linear_checks.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

namespace torch_sparse_metal {
namespace {

bool is_value_type(at::ScalarType type) {
#define TSM_IS(name, scalar_type, ...) \
  if (type == at::ScalarType::scalar_type) return true;
  TSM_FOR_EACH_DTYPE(TSM_IS)
#undef TSM_IS
  return false;
}

const char* value_type_names() {
#define TSM_LISTED(name, ...) " " #name
  return "{" TSM_FOR_EACH_DTYPE(TSM_LISTED) " }";
#undef TSM_LISTED
}

void check_index(const at::Tensor& t, const char* name, int64_t numel, const at::Tensor& x) {
  TORCH_CHECK(t.scalar_type() == at::kInt, "torch_sparse_metal: ", name, " must be int32, got ", t.scalar_type(),
              " (build index tensors with CSRTopology, which keeps int32 copies for the kernels)");
  TORCH_CHECK(t.dim() == 1 && t.numel() == numel, "torch_sparse_metal: ", name, " must be 1-D with ", numel,
              " elements, got shape ", t.sizes());
  TORCH_CHECK(t.device() == x.device(), "torch_sparse_metal: ", name, " is on ", t.device(), " but x is on ",
              x.device(), "; move the layer and its input to one device");
  TORCH_CHECK(t.is_contiguous(), "torch_sparse_metal: ", name, " must be contiguous");
}

void check_values(const at::Tensor& t, const char* name, const at::Tensor& x) {
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), "torch_sparse_metal: ", name, " has dtype ", t.scalar_type(),
              " but x has dtype ", x.scalar_type(), "; cast both to one dtype");
  TORCH_CHECK(t.device() == x.device(), "torch_sparse_metal: ", name, " is on ", t.device(), " but x is on ",
              x.device());
}

void check_x(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "torch_sparse_metal: x must be 2-D [batch, in_features], got shape ", x.sizes());
  TORCH_CHECK(is_value_type(x.scalar_type()), "torch_sparse_metal: x must be one of ", value_type_names(),
              ", got ", x.scalar_type());
}

// Checks of the by-source arrays of a topology with `edges` edges (connections), beside x.
void check_by_source(const at::Tensor& x, int64_t edges, const at::Tensor& row_ptr, const at::Tensor& dst,
                     const at::Tensor& src) {
  TORCH_CHECK(row_ptr.numel() == x.size(1) + 1, "torch_sparse_metal: row_ptr has ", row_ptr.numel(),
              " elements but x has in_features=", x.size(1), " (expected in_features + 1)");
  check_index(row_ptr, "row_ptr", x.size(1) + 1, x);
  check_index(dst, "dst", edges, x);
  check_index(src, "src", edges, x);
}

// The weight of one of contract.h's layouts (layout_of refuses any other shape). Returns its connections (edges or
// vectors), which the by-source and by-destination arrays index.
int64_t check_weight(const at::Tensor& x, const at::Tensor& weight) {
  layout_of(weight);
  check_values(weight, "weight", x);
  return weight.size(0);
}

// A weight whose length differs from a topology whose per-connection arrays agree with each other is the weight's
// fault, named here; an array that disagrees with the others is named by check_by_source or check_by_destination.
void check_weight_fits(const at::Tensor& weight, int64_t connections, const at::Tensor& dst, const at::Tensor& src,
                       const at::Tensor& src_by_dst, const at::Tensor& perm) {
  const int64_t edges = dst.numel();
  for (const at::Tensor* t : {&dst, &src, &src_by_dst, &perm})
    if (t->dim() != 1 || t->numel() != edges) return;
  const bool vectors = layout_block(weight) > 1;
  TORCH_CHECK(connections == edges, "torch_sparse_metal: weight has shape ", weight.sizes(), ", ", connections,
              vectors ? " vectors" : " values", ", but the topology has ", edges, vectors ? " vectors" : " edges",
              " (dst, src, src_by_dst and perm have ", edges, " elements): the weight needs one ",
              vectors ? "row" : "value", " per connection of the topology");
}

void check_by_destination(const at::Tensor& x, int64_t edges, const at::Tensor& col_ptr,
                          const at::Tensor& src_by_dst, const at::Tensor& perm) {
  TORCH_CHECK(col_ptr.dim() == 1 && col_ptr.numel() >= 1,
              "torch_sparse_metal: col_ptr must be 1-D [out_features + 1], got shape ", col_ptr.sizes());
  check_index(col_ptr, "col_ptr", col_ptr.numel(), x);
  check_index(src_by_dst, "src_by_dst", edges, x);
  check_index(perm, "perm", edges, x);
  // An edge needs a source and a destination; the device kernels' index guards rely on both ranges being
  // non-empty.
  TORCH_CHECK(edges == 0 || (x.size(1) > 0 && col_ptr.numel() > 1), "torch_sparse_metal: ", edges,
              " edges but in_features=", x.size(1), " and out_features=", col_ptr.numel() - 1,
              "; a layer with no inputs or no outputs has no edges");
}

}  // namespace

int64_t out_features(const at::Tensor& weight, const at::Tensor& col_ptr) {
  return (col_ptr.numel() - 1) * layout_block(weight);
}

void check_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& row_ptr,
                   const at::Tensor& dst, const at::Tensor& src, const at::Tensor& col_ptr,
                   const at::Tensor& src_by_dst, const at::Tensor& perm) {
  check_x(x);
  const int64_t edges = check_weight(x, weight);
  check_weight_fits(weight, edges, dst, src, src_by_dst, perm);
  check_by_source(x, edges, row_ptr, dst, src);
  check_by_destination(x, edges, col_ptr, src_by_dst, perm);
}

void check_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                    const at::Tensor& row_ptr, const at::Tensor& dst, const at::Tensor& src,
                    const at::Tensor& col_ptr, const at::Tensor& src_by_dst, const at::Tensor& perm) {
  check_forward(x, weight, row_ptr, dst, src, col_ptr, src_by_dst, perm);
  TORCH_CHECK(grad_out.dim() == 2 && grad_out.size(0) == x.size(0),
              "torch_sparse_metal: grad_out must be [batch, out_features] with batch=", x.size(0), ", got shape ",
              grad_out.sizes());
  check_values(grad_out, "grad_out", x);
  const int64_t out = out_features(weight, col_ptr);
  TORCH_CHECK(grad_out.size(1) == out, "torch_sparse_metal: grad_out has ", grad_out.size(1),
              " columns but the topology has out_features=", out,
              layout_block(weight) > 1 ? " (" + std::to_string(col_ptr.numel() - 1) + " groups of " +
                                             std::to_string(layout_block(weight)) + ")"
                                       : std::string());
}

namespace {

// Branch-free first passes (they vectorise); only a failed one is walked again to name the first bad index.
void check_pointers(const at::Tensor& t, const char* name, int64_t edges) {
  const int32_t* p = t.data_ptr<int32_t>();
  const int64_t n = t.numel();
  bool ok = p[0] == 0 && p[n - 1] == edges;
  for (int64_t i = 1; i < n; ++i) ok &= p[i] >= p[i - 1];
  if (ok) return;
  int64_t i = p[0] != 0 ? 0 : n - 1;
  for (int64_t j = 1; j < n; ++j)
    if (p[j] < p[j - 1]) {
      i = j;
      break;
    }
  TORCH_CHECK(false, "torch_sparse_metal: ", name, " is not a CSR pointer array for ", edges, " edges: ", name, "[",
              i, "] = ", p[i], " (it must start at 0, never decrease, and end at ", edges, ")");
}

void check_range(const at::Tensor& t, const char* name, int64_t limit, const char* limit_name) {
  const int32_t* v = t.data_ptr<int32_t>();
  const int64_t n = t.numel();
  const uint32_t bound = static_cast<uint32_t>(std::min<int64_t>(limit, std::numeric_limits<int32_t>::max()));
  bool ok = true;
  for (int64_t e = 0; e < n; ++e) ok &= static_cast<uint32_t>(v[e]) < bound;  // negatives wrap past the bound
  if (ok) return;
  for (int64_t e = 0; e < n; ++e)
    TORCH_CHECK(v[e] >= 0 && v[e] < limit, "torch_sparse_metal: ", name, "[", e, "] = ", v[e], " is outside [0, ",
                limit_name, " = ", limit, ")");
}

// The orders agree: position k of output o's by-destination range holds an edge perm[k] < edges, which goes to o
// (dst[perm[k]] == o) and lies in the row of an input src_by_dst[k] < in_features (row_ptr), and each output lists
// its sources in increasing order (no edge twice). Two positions holding one edge would then have one source and
// one output, which the increasing order forbids, so perm is a permutation (no bitmap needed), every edge is
// reached and every dst value is an output. The pointer arrays must be valid already (they bound the loops); an
// out-of-range perm or src_by_dst value is read as 0 and makes the result false, so nothing outside the arrays is
// read. One pass, one gather of dst per edge, in parallel over blocks of outputs (reads only).
bool orders_agree(int64_t edges, int64_t in_features, int64_t out_features, const int32_t* rp, const int32_t* d,
                  const int32_t* cp, const int32_t* sb, const int32_t* p) {
  std::atomic<bool> agree{true};
  const auto n_edges = static_cast<uint32_t>(edges), n_in = static_cast<uint32_t>(in_features);
  const int64_t grain = std::max<int64_t>(1, out_features * 32768 / std::max<int64_t>(edges, 1));
  at::parallel_for(0, out_features, grain, [&](int64_t o0, int64_t o1) {
    bool ok = true;
    for (int64_t o = o0; o < o1; ++o) {
      int64_t previous = -1;
      for (int64_t k = cp[o]; k < cp[o + 1]; ++k) {
        uint32_t e = static_cast<uint32_t>(p[k]), q = static_cast<uint32_t>(sb[k]);  // negatives wrap past the bounds
        const bool inside = (e < n_edges) & (q < n_in);
        e = inside ? e : 0;
        q = inside ? q : 0;
        ok &= inside & (d[e] == o) & (e - static_cast<uint32_t>(rp[q]) < static_cast<uint32_t>(rp[q + 1] - rp[q])) &
              (static_cast<int64_t>(q) > previous);
        previous = q;
      }
    }
    if (!ok) agree.store(false, std::memory_order_relaxed);
  });
  return agree.load();
}

// Names the first disagreement orders_agree found (a failed check only: this costs what it costs).
[[noreturn]] void report_disagreement(int64_t edges, int64_t out_features, const int32_t* rp, const int32_t* d,
                                      const int32_t* cp, const int32_t* sb, const int32_t* p) {
  const char* advice =
      "; the by-destination arrays (col_ptr, src_by_dst, perm: what the forward walks) must list exactly the edges "
      "of the by-source arrays (row_ptr, dst: what the backward walks), each once, or the gradients are not those "
      "of the forward (build topologies with CSRTopology). From a SparseLinear in a compiled model this means its "
      "row_ptr and dst were written in place without the layer (torch.distributed.checkpoint's dcp.load into "
      "state_dict() tensors): call model.load_state_dict(state) after dcp.load, which rebuilds the arrays derived "
      "from them";
  std::vector<int64_t> first(static_cast<size_t>(edges), -1);
  for (int64_t k = 0; k < edges; ++k) {
    TORCH_CHECK(first[p[k]] < 0, "torch_sparse_metal: perm is not a permutation of the ", edges, " edges: perm[",
                first[p[k]], "] and perm[", k, "] are both ", p[k], ", so the forward would read that edge's weight "
                "twice and another's never", advice);
    first[p[k]] = k;
  }
  for (int64_t o = 0; o < out_features; ++o)
    for (int64_t k = cp[o]; k < cp[o + 1]; ++k) {
      const int32_t e = p[k], q = sb[k];
      TORCH_CHECK(d[e] == o, "torch_sparse_metal: perm[", k, "] = ", e, " puts edge ", e, " among the edges into "
                  "output ", o, " (col_ptr), but dst[", e, "] = ", d[e], advice);
      TORCH_CHECK(rp[q] <= e && e < rp[q + 1], "torch_sparse_metal: src_by_dst[", k, "] = ", q, " says edge perm[",
                  k, "] = ", e, " comes from input ", q, ", but row_ptr puts edges ", rp[q], " .. ", rp[q + 1] - 1,
                  " there", advice);
      TORCH_CHECK(k == cp[o] || q > sb[k - 1], "torch_sparse_metal: output ", o, " lists source ", q,
                  " (src_by_dst[", k, "]) after source ", sb[k - 1], "; each output lists its edges by increasing "
                  "source, each once", advice);
    }
  TORCH_CHECK(false, "torch_sparse_metal: the by-destination and by-source arrays disagree", advice);
}

}  // namespace

void check_topology_cpu(int64_t edges, int64_t in_features, int64_t out_features, const at::Tensor& row_ptr,
                        const at::Tensor& dst, const at::Tensor& /*src*/, const at::Tensor& col_ptr,
                        const at::Tensor& src_by_dst, const at::Tensor& perm) {
  // The pointer arrays bound every loop: first. Then one pass that holds the rest (orders_agree); only when it
  // fails are the arrays walked again, in order, to name the first bad value. src is read by no CPU kernel (an
  // edge's source is the row of row_ptr holding it), so the CPU neither bounds nor compares it.
  check_pointers(row_ptr, "row_ptr", edges);
  check_pointers(col_ptr, "col_ptr", edges);
  const int32_t *rp = row_ptr.data_ptr<int32_t>(), *d = dst.data_ptr<int32_t>(), *cp = col_ptr.data_ptr<int32_t>();
  const int32_t *sb = src_by_dst.data_ptr<int32_t>(), *p = perm.data_ptr<int32_t>();
  if (orders_agree(edges, in_features, out_features, rp, d, cp, sb, p)) return;
  check_range(dst, "dst", out_features, "out_features");
  check_range(src_by_dst, "src_by_dst", in_features, "in_features");
  check_range(perm, "perm", edges, "nnz");
  report_disagreement(edges, out_features, rp, d, cp, sb, p);
}

void check_int32_sizes(const at::Tensor& x, const char* backend) {
  TORCH_CHECK(x.size(0) <= std::numeric_limits<int32_t>::max() && x.size(1) <= std::numeric_limits<int32_t>::max(),
              "torch_sparse_metal: sizes beyond int32 are not supported by the ", backend, " kernels, got ", x.sizes());
}

namespace {
std::atomic<bool> poison_outputs{false};
}  // namespace

void set_poison(bool on) { poison_outputs.store(on, std::memory_order_relaxed); }
bool poison() { return poison_outputs.load(std::memory_order_relaxed); }

}  // namespace torch_sparse_metal
