--[[ claim: a worker takes one waiting request, atomically with its lease. Its slot is chosen
once the worker has the prompt, and recorded by the step's report (report.lua). A request past
its queue deadline is never claimed: it expires here instead (so a worker racing the sweep
cannot take it), and the caller reads the new head.
Moves: waiting -> running, waiting -> expired
KEYS: waiting zset, running zset, request hash, claim counter, deadlines zset, output stream,
  metrics hash
ARGV: member (as read from the head of waiting), request id, worker id, now (ms),
  lease deadline (ms), retention (s) of an expired request
Returns {result} or {CLAIMED, the request hash as a flat list}; result (ClaimResult):
GONE another worker took the member first, EXPIRED its queue deadline passed (it expired here). ]]
local waiting, running, req, claims, deadlines, out, metrics = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7]
local member, id, worker, now, lease_deadline, ttl = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local GONE, CLAIMED, EXPIRED = 0, 1, 2

if not redis.call('ZSCORE', waiting, member) then
  return {GONE}
end
if overdue(req, now) then
  expire(waiting, deadlines, req, out, metrics, id, now, tonumber(ttl))
  return {EXPIRED}
end
redis.call('ZREM', waiting, member)
redis.call('ZREM', deadlines, id)
redis.call('ZADD', running, lease_deadline, id)
redis.call('HSET', req, 'status', 'running', 'worker', worker, 'slot', '', 'claimed_ms', now)
redis.call('HINCRBY', req, 'attempts', 1)
-- the model's n-th claim: the order in which requests got slots, across all workers
redis.call('HSET', req, 'claim_seq', redis.call('INCR', claims))
return {CLAIMED, redis.call('HGETALL', req)}
