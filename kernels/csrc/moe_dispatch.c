/* The expert dispatch of one MoE layer on the CPU, one call each side (moe_dispatch.py):
 *
 * plan_dispatch (attention side): each routed entry (token, top-k slot) gets a replica by the
 * placement's round-robin rule (the n-th entry of an expert in token order takes replica
 * n % count), then the entries are counting-sorted by (owning worker, replica), stable, and cut
 * into one batch per worker: the distinct tokens it needs (ascending), each entry's row among
 * them, and its replica groups (slot, logical expert, entries). What services/expert's
 * sort_entries + split_by_worker compute with ~25 numpy calls.
 *
 * check_groups (expert side): a request's replica groups and row ids checked against the
 * worker's placement in one pass, with the int64 copies the compute reads.
 *
 * Indices are int32 in the outputs (what the frames carry), int64 in the tables (numpy's).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Bad input: which check failed (the caller names the value). */
#define DISPATCH_BAD_EXPERT -1  /* a logical id outside [0, num_experts) or with no replica */
#define DISPATCH_BAD_SLOT -2    /* a replica outside [0, num_slots) */
#define DISPATCH_NO_MEMORY -3

/* Output layout of plan_dispatch, int32, n = num_tokens * top_k entries:
 *   order[n] replicas[n] experts[n] tokens[n]   the entries sorted by (owner, replica): flat index, replica, expert, token
 *   rows[n]                                     row of each sorted entry among its worker's tokens
 *   group_slots[n] group_experts[n] group_sizes[n]   the first num_groups used, worker by worker
 *   token_ids[n]                                each worker's distinct tokens, worker by worker
 *   batches[num_slots][7]                       worker, entries [begin, end), groups [begin, end), tokens [begin, end)
 * and weights_out[n] float32: each sorted entry's gate weight. Returns the number of batches, or a
 * DISPATCH_* code (nothing is half-written that the caller reads). */
int64_t plan_dispatch(const int64_t *topk_ids, const float *topk_weights, int64_t num_tokens, int64_t top_k,
                      const int64_t *log2phy, const int64_t *replica_counts, int64_t num_experts,
                      int64_t max_replicas, const int64_t *slot_owner, const int64_t *slot_rank, int64_t num_slots,
                      int32_t *out, float *weights_out) {
    const int64_t n = num_tokens * top_k;
    int32_t *order = out, *replicas = out + n, *experts = out + 2 * n, *tokens = out + 3 * n, *rows = out + 4 * n;
    int32_t *group_slots = out + 5 * n, *group_experts = out + 6 * n, *group_sizes = out + 7 * n;
    int32_t *token_ids = out + 8 * n, *batches = out + 9 * n;
    int32_t *flat = group_slots; /* each flat entry's replica until the sort has read them */
    int64_t *scratch = calloc((size_t)(num_slots + 1 + num_experts + num_tokens), sizeof(int64_t));
    if (scratch == NULL) return DISPATCH_NO_MEMORY;
    int64_t *starts = scratch, *seen = scratch + num_slots + 1, *row_of = seen + num_experts;
    int64_t result = 0;

    for (int64_t i = 0; i < n; i++) {
        const int64_t e = topk_ids[i];
        if (e < 0 || e >= num_experts) { result = DISPATCH_BAD_EXPERT; goto done; }
        int64_t r = e;
        if (log2phy != NULL) {
            const int64_t count = replica_counts[e];
            if (count < 1 || count > max_replicas) { result = DISPATCH_BAD_EXPERT; goto done; }
            r = log2phy[e * max_replicas + seen[e]++ % count];
        }
        if (r < 0 || r >= num_slots) { result = DISPATCH_BAD_SLOT; goto done; }
        flat[i] = (int32_t)r;
        starts[slot_rank[r] + 1]++;
    }
    for (int64_t s = 0; s < num_slots; s++) starts[s + 1] += starts[s];
    for (int64_t i = 0; i < n; i++) { /* stable: entries of one replica stay in token order */
        const int64_t p = starts[slot_rank[flat[i]]]++;
        order[p] = (int32_t)i;
        replicas[p] = flat[i];
        experts[p] = (int32_t)topk_ids[i];
        tokens[p] = (int32_t)(i / top_k);
        weights_out[p] = topk_weights[i];
    }

    int64_t num_groups = 0, num_batches = 0, num_listed = 0;
    for (int64_t begin = 0; begin < n;) { /* one worker's run of entries */
        const int64_t worker = slot_owner[replicas[begin]];
        int64_t end = begin, first_group = num_groups;
        while (end < n && slot_owner[replicas[end]] == worker) {
            if (end == begin || replicas[end] != replicas[end - 1]) {
                group_slots[num_groups] = replicas[end];
                group_experts[num_groups] = experts[end];
                group_sizes[num_groups++] = 0;
            }
            group_sizes[num_groups - 1]++;
            row_of[tokens[end++]] = 1;
        }
        const int64_t first_token = num_listed;
        for (int64_t t = 0; t < num_tokens; t++) {
            if (row_of[t]) {
                row_of[t] = num_listed - first_token;
                token_ids[num_listed++] = (int32_t)t;
            } else {
                row_of[t] = -1;
            }
        }
        for (int64_t p = begin; p < end; p++) rows[p] = (int32_t)row_of[tokens[p]];
        memset(row_of, 0, (size_t)num_tokens * sizeof(int64_t));
        int32_t *batch = batches + 7 * num_batches++;
        batch[0] = (int32_t)worker;
        batch[1] = (int32_t)begin, batch[2] = (int32_t)end;
        batch[3] = (int32_t)first_group, batch[4] = (int32_t)num_groups;
        batch[5] = (int32_t)first_token, batch[6] = (int32_t)num_listed;
        begin = end;
    }
    result = num_batches;
done:
    free(scratch);
    return result;
}

/* Bad request groups: check_groups' result. */
#define GROUPS_BAD_SLOT -1      /* a slot outside [0, num_slots) */
#define GROUPS_BAD_SIZE -2      /* a negative entry count */
#define GROUPS_NOT_LOCAL -3     /* a slot this worker does not hold */
#define GROUPS_WRONG_EXPERT -4  /* the slot holds another expert in this layer */
#define GROUPS_ROW_COUNT -5     /* row ids are not as many as the groups' entries */
#define GROUPS_BAD_ROW -6       /* a row id outside [0, num_rows) */

/* Checks a request's groups (slot, expert, entries) and row ids against the worker's tables:
 * local_index[num_slots] (-1: not held here) and phy2log[num_slots] (the layer's row). Writes into
 * out (int64): group_local[num_groups] (each group's local replica), group_rows[num_groups], the
 * row ids [num_row_ids], then the offending group or row index; returns 0 or a GROUPS_* code. */
int64_t check_groups(const int32_t *slots, const int32_t *experts, const int32_t *sizes, int64_t num_groups,
                     const int32_t *row_ids, int64_t num_row_ids, int64_t num_rows, const int64_t *local_index,
                     const int64_t *phy2log, int64_t num_slots, int64_t *out) {
    int64_t *group_local = out, *group_rows = out + num_groups, *rows_out = out + 2 * num_groups;
    int64_t *bad = rows_out + num_row_ids;
    int64_t num_entries = 0;
    for (int64_t g = 0; g < num_groups; g++) {
        *bad = g;
        const int64_t slot = slots[g];
        if (slot < 0 || slot >= num_slots) return GROUPS_BAD_SLOT;
        if (sizes[g] < 0) return GROUPS_BAD_SIZE;
        if (local_index[slot] < 0) return GROUPS_NOT_LOCAL;
        if (phy2log[slot] != experts[g]) return GROUPS_WRONG_EXPERT;
        group_local[g] = local_index[slot];
        group_rows[g] = sizes[g];
        num_entries += sizes[g];
    }
    *bad = num_entries;
    if (num_entries != num_row_ids) return GROUPS_ROW_COUNT;
    for (int64_t i = 0; i < num_row_ids; i++) {
        if (row_ids[i] < 0 || row_ids[i] >= num_rows) { *bad = i; return GROUPS_BAD_ROW; }
        rows_out[i] = row_ids[i];
    }
    return 0;
}
