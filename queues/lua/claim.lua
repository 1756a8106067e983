--[[ claim: a worker takes one waiting request, atomically with its lease. Its slot is chosen
once the worker has the prompt, and recorded by the step's report (report.lua). A request past
its queue deadline is never claimed: it expires here instead (so a worker racing the sweep
cannot take it), and the caller reads the new head.
Moves: waiting -> running, waiting -> expired
KEYS[1] waiting zset   KEYS[2] running zset   KEYS[3] request hash   KEYS[4] claim counter
KEYS[5] deadlines zset   KEYS[6] output stream   KEYS[7] metrics hash
ARGV[1] member (as read from the head of waiting)   ARGV[2] id   ARGV[3] worker id
ARGV[4] now (ms)   ARGV[5] lease deadline (ms)   ARGV[6] retention (s) of an expired request
Returns the request hash as a flat list; nil when another worker took the member first; 0 when
it expired here. ]]
if not redis.call('ZSCORE', KEYS[1], ARGV[1]) then
  return nil
end
if overdue(KEYS[3], ARGV[4]) then
  expire(KEYS[1], KEYS[5], KEYS[3], KEYS[6], KEYS[7], ARGV[2], ARGV[4], tonumber(ARGV[6]))
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[2])
redis.call('HSET', KEYS[3], 'status', 'running', 'worker', ARGV[3], 'slot', '', 'claimed_ms', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'attempts', 1)
-- the model's n-th claim: the order in which requests got slots, across all workers
redis.call('HSET', KEYS[3], 'claim_seq', redis.call('INCR', KEYS[4]))
return redis.call('HGETALL', KEYS[3])
