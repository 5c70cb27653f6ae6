// megaloop/attention_keys.cuh: what every attention tile agrees on (megaloop/attention.cuh's paths and
// megaloop/attention_lanes.cuh's): an op's shapes and mask (AttnShape), which keys a query sees, the
// append form's new key and value, and the mask operand's term.
#pragma once
#include "megaloop/elementwise.cuh"
#include "megaloop/math.cuh"
#include "megaloop/types.cuh"

namespace ml {

// An op's shapes and mask (megaloop/frontend/ops/attention.py): Group query heads a kv head, Tq queries
// and Tk keys a batch item, heads of D and values of Dv; Causal, with a sliding Window (0: none); the
// scores' softcap as the bits of its float32 (0: none; C++17 takes no float template arguments; ml::softcap).
template <int Group, int Tq, int Tk, int D, int Dv, bool Causal = false, int Window = 0, unsigned CapBits = 0u>
struct AttnShape {
    static_assert(Group > 0 && D > 0 && Dv > 0 && Window >= 0, "AttnShape: query heads a kv head, dims, window >= 0");
    static_assert(Window == 0 || Causal, "AttnShape: a sliding window needs causal attention");
    static constexpr int group = Group, tq = Tq, tk = Tk, d = D, dv = Dv, window = Window;
    static constexpr bool causal = Causal;
    static constexpr unsigned cap_bits = CapBits;
};

// an i64 the front end folds as it would a literal: a length of Tk passed on as a value instead made
// the visible range's code a few instructions longer
template <i64 V>
struct Known {
    __device__ __forceinline__ constexpr operator i64() const { return V; }
};

// batch item bi's keys: lens[bi] (checked by the caller), or all Tk where the op has no lengths
template <int Tk, class L>
__device__ __forceinline__ auto kv_length(const L& lens, int bi) {
    if constexpr (is_present<L>::value) return (i64)load(lens.p + (i64)bi * stride_of<0, L>);
    else return Known<Tk>{};
}

// the keys [begin, end) query i of batch item bi sees among its first len: up to its position (qpos,
// else the last Tq of len are the queries) where causal, at most Window of them
template <class S, class QP, class Len>
__device__ __forceinline__ void visible_keys(const QP& qpos, int bi, int i, Len len, i64& begin, i64& end) {
    i64 qp;
    if constexpr (is_present<QP>::value) qp = load(qpos.p + (i64)bi * stride_of<0, QP> + (i64)i * stride_of<1, QP>);
    else qp = len - S::tq + i;
    if constexpr (S::causal) {
        end = qp + 1 < len ? qp + 1 : len;
        if constexpr (S::window > 0) begin = qp - S::window + 1;
        else begin = 0;
        if (begin < 0) begin = 0;
    } else {
        begin = 0;
        end = len;
    }
}

// attention_partial's append form (a decode step): rope's frequencies, rotary dims and layout, and
// the step's un-roped key and value kn, vn [B, Hkv, 1, D] (axis 2 never indexed). q arrives un-roped:
// the tiles rotate it at its position, where the key is rope(kn) and the value vn (not in the caches).
template <int RD, bool Neox, class KN, class VN>
struct AttnAppend {
    static constexpr int rd = RD;
    static constexpr bool neox = Neox;
    const double* inv_freq;
    KN k;
    VN v;
};
template <int RD, bool Neox, class KN, class VN>
__device__ __forceinline__ AttnAppend<RD, Neox, KN, VN> attn_append(const double* inv_freq, KN k, VN v) {
    return {inv_freq, k, v};
}

// query i of batch item bi's position (the append form's new key's slot)
template <class QP>
__device__ __forceinline__ i64 query_position(const QP& qpos, int bi, int i) {
    return load(qpos.p + (i64)bi * stride_of<0, QP> + (i64)i * stride_of<1, QP>);
}

// The mask operand's term for key j of query i of head h, batch item bi (its strides in the scores'
// [batch, heads, queries, keys] index space, 0 where it broadcasts): 0 or -inf for a bool mask
// (False hides the key), the value of a float one (added to the softcapped score); 0 without one.
__device__ __forceinline__ float mask_score(bool seen) { return seen ? 0.0f : neg_inf(); }
__device__ __forceinline__ float mask_score(float added) { return added; }
// s with the mask's term added (s itself without a mask)
template <class M>
__device__ __forceinline__ float with_mask(float s, const M& mask, int bi, int h, int i, i64 j) {
    if constexpr (!is_present<M>::value) {
        return s;
    } else {
        return s + mask_score(load(mask.p + (i64)bi * stride_of<0, M> + (i64)h * stride_of<1, M> +
                                   (i64)i * stride_of<2, M> + j * stride_of<3, M>));
    }
}

}  // namespace ml
