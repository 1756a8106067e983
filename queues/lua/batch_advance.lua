--[[ batch_advance: move a batch to its next status, only from the statuses that lead there.
KEYS[1] batch hash
ARGV[1] batch id   ARGV[2] statuses it may leave, space separated   ARGV[3] the new status
ARGV[4] the timestamp field to set ('' for none)   ARGV[5] now (s)
Returns the status after the call: the new one, or the unchanged one when it was not allowed
(e.g. cancel on a completed batch; in_progress -> finalizing after a cancel arrived).
Errors: NOT_FOUND (no such batch).
The set of active batches is not touched here: it is global, in another Cluster slot than the
batch's own keys. BatchStore.advance drops a batch that ended from it afterwards; a process that
dies in between leaves an ended batch there, which the sweep drops (it skips ended batches). ]]
local status = redis.call('HGET', KEYS[1], 'status')
if not status then
  return redis.error_reply('NOT_FOUND')
end
for allowed in string.gmatch(ARGV[2], '%S+') do
  if allowed == status then
    redis.call('HSET', KEYS[1], 'status', ARGV[3])
    if ARGV[4] ~= '' then
      redis.call('HSET', KEYS[1], ARGV[4], ARGV[5])
    end
    return ARGV[3]
  end
end
return status
