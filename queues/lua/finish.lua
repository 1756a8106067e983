--[[ finish: a request ends (done, failed, or cancelled by its client); its slot is free.
KEYS[1] running zset   KEYS[2] request hash   KEYS[3] output stream   KEYS[4] metrics hash
ARGV[1] id   ARGV[2] worker id   ARGV[3] final status (finished|failed|cancelled)
ARGV[4] now (ms)   ARGV[5] retention (s) of the hash and stream after the end
ARGV[6] completion tokens   ARGV[7] finish reason
ARGV[8] histogram bucket upper bounds in ms, comma-separated, ascending (queues/metrics.py)
ARGV[9..] the last stream event as field, value pairs (none for a cancel)
Returns 1, or 0 when this worker no longer owns the request (its lease expired and it was
requeued): then nothing is written, so a request never ends twice, and is counted once.
Metrics (fields of KEYS[4], by the request's priority p, see queues/metrics.py):
  requests:<p>:<status> +1; for a finished request also prompt_tokens:<p>, completion_tokens:<p>
  and one observation in each histogram (queue_ms, first_token_ms, latency_ms): the bucket
  <name>:<p>:le=<bound> (non-cumulative; le=+Inf above the last bound) and <name>:<p>:sum. ]]
if redis.call('HGET', KEYS[2], 'worker') ~= ARGV[2] or redis.call('HGET', KEYS[2], 'status') ~= 'running' then
  return 0
end
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HSET', KEYS[2], 'status', ARGV[3], 'finished_ms', ARGV[4],
  'completion_tokens', ARGV[6], 'finish_reason', ARGV[7])
if #ARGV >= 9 then
  redis.call('XADD', KEYS[3], '*', unpack(ARGV, 9))
end

local p = redis.call('HGET', KEYS[2], 'priority') or '0'
redis.call('HINCRBY', KEYS[4], 'requests:' .. p .. ':' .. ARGV[3], 1)
if ARGV[3] == 'finished' then
  local now = tonumber(ARGV[4])
  local t = redis.call('HMGET', KEYS[2], 'enqueued_ms', 'claimed_ms', 'first_token_ms', 'prompt_tokens')
  local enqueued = tonumber(t[1]) or now
  local claimed = tonumber(t[2]) or now
  local first = tonumber(t[3]) or now  -- no token event (an immediate end): the done event is first
  redis.call('HINCRBY', KEYS[4], 'prompt_tokens:' .. p, tonumber(t[4]) or 0)
  redis.call('HINCRBY', KEYS[4], 'completion_tokens:' .. p, tonumber(ARGV[6]) or 0)
  local function observe(name, value)
    if value < 0 then value = 0 end
    local le = '+Inf'
    for bound in string.gmatch(ARGV[8], '[^,]+') do
      if value <= tonumber(bound) then
        le = bound
        break
      end
    end
    redis.call('HINCRBY', KEYS[4], name .. ':' .. p .. ':le=' .. le, 1)
    redis.call('HINCRBY', KEYS[4], name .. ':' .. p .. ':sum', value)
  end
  observe('queue_ms', claimed - enqueued)
  observe('first_token_ms', first - enqueued)
  observe('latency_ms', now - enqueued)
end

local ttl = tonumber(ARGV[5])
if ttl > 0 then
  redis.call('EXPIRE', KEYS[2], ttl)
  redis.call('EXPIRE', KEYS[3], ttl)
end
return 1
