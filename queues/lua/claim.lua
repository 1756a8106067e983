--[[ claim: a worker takes one waiting request, atomically with its lease. Its slot is chosen
once the worker has the prompt, and recorded by the step's report (report.lua).
Moves: waiting -> running
KEYS[1] waiting zset   KEYS[2] running zset   KEYS[3] request hash   KEYS[4] claim counter
ARGV[1] member (as read from the head of waiting)   ARGV[2] id   ARGV[3] worker id
ARGV[4] now (ms)   ARGV[5] lease deadline (ms)
Returns the request hash as a flat list, or nil when another worker took the member first
(the caller reads the new head and tries again). ]]
if redis.call('ZREM', KEYS[1], ARGV[1]) == 0 then
  return nil
end
redis.call('ZADD', KEYS[2], ARGV[5], ARGV[2])
redis.call('HSET', KEYS[3], 'status', 'running', 'worker', ARGV[3], 'slot', '', 'claimed_ms', ARGV[4])
redis.call('HINCRBY', KEYS[3], 'attempts', 1)
-- the model's n-th claim: the order in which requests got slots, across all workers
redis.call('HSET', KEYS[3], 'claim_seq', redis.call('INCR', KEYS[4]))
return redis.call('HGETALL', KEYS[3])
